"""trajmesh.services."""
