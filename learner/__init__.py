"""trajmesh.learner."""
