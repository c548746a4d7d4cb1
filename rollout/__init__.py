"""trajmesh.rollout."""
