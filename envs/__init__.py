"""trajmesh.envs."""
