"""trajmesh.graders."""
