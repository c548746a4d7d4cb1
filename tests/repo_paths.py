"""Where the tests find the repository and their own support files, wherever a test file sits."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
