"""Weights on the shared volume, torch-free: what the learner publishes and the rollout loads.

- `trajmesh.weights.layout`: where versions live on the volume (`RUN_DIR/weights/v{version:06d}-{ns}`, its checksum,
  written under a hidden temp name and renamed in), the only place those names are spelled.
- `trajmesh.weights.delta`: ``weights.sync: delta``, the codec (per version only the tensors whose
  bytes changed, a full anchor now and then), the learner's writer, the pruning rule and the
  rollout's reconstruction of the full checkpoint on its own disk (`LocalWeights`).
- `trajmesh.weights.announce`: which version is where: the learner's announcement (KV ``latest``, then
  the WEIGHTS stream), the rollouts' watch with its poll, and the delta rollouts' anchor requests.

The learner (learner/weights.py, services/learner.py) writes through it and the rollout
(services/rollout.py) reads through it; it imports none of their code, only the bus for NATS (torch stays out).
"""
