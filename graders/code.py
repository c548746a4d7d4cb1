"""Code tests executed in the sandbox (no torch).

The program is the last fenced ```python block (else the whole response); the tests are asserts
from the task (`metadata.tests`), appended and run in one sandboxed process that prints one line
per passed test. Reward = all tests pass; the pass ratio and the sandbox outcome are components.
"""

from __future__ import annotations

import re
from typing import Any

from trajmesh.graders.base import Grade, Sample

from trajmesh import sandbox

HARNESS = """
__tm_passed = 0
for __tm_i, __tm_src in enumerate({tests!r}):
    try:
        exec(__tm_src, globals())
        __tm_passed += 1
    except Exception as __tm_e:
        print("FAIL", __tm_i, type(__tm_e).__name__)
print("PASSED", __tm_passed)
"""


def extract_program(text: str) -> tuple[str, bool]:
    blocks = re.findall(r"```(?:python)?\n(.*?)```", text, flags=re.DOTALL)
    return (blocks[-1], True) if blocks else (text, False)


class CodeTestsGrader:
    revision = "code-tests-sandbox-v1"
    components = ("all_passed", "pass_ratio", "format_code_block", "sandbox_error")

    def __init__(self, limits: sandbox.SandboxLimits | None = None) -> None:
        self.limits = limits or sandbox.SandboxLimits(wall_s=10.0, cpu_s=5)

    def grade(self, sample: Sample, task: dict[str, Any]) -> Grade:
        tests = list(task["metadata"]["tests"])
        program, fenced = extract_program(sample.text)
        res = sandbox.run_code(program + "\n" + HARNESS.format(tests=tests), limits=self.limits)
        m = re.search(r"^PASSED (\d+)$", res.stdout, flags=re.MULTILINE)
        passed = int(m.group(1)) if m and not res.subclass else 0
        ratio = passed / max(1, len(tests))
        components = {"all_passed": float(passed == len(tests)), "pass_ratio": ratio,
                      "format_code_block": float(fenced), "sandbox_error": float(bool(res.subclass))}
        out = f"status={res.status} subclass={res.subclass} passed={passed}/{len(tests)}"
        return Grade(components["all_passed"], components, out, self.revision)
