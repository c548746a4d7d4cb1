"""trajmesh: fully asynchronous RL for language-model agents, built as a service mesh.

This folder is the core every service shares, torch-free (docs/ARCHITECTURE.md):

    contract.py     the trajectory contract around the `trajmesh.v1` protos (v1/: generated code)
    token_block.py  the packed columnar block a trajectory's per-token arrays travel in
    config.py       the typed run configuration, one YAML file
    plugins.py      the plug-in registry: task sources, engines, graders ("module:attr", loaded lazily)
    bus.py          the JetStream layout and a typed wrapper over nats-py
    gate.py         the staleness gate (η), its counters in Redis
    service.py      the service lifecycle (setup → run → stop), stop budgets, the stop watchdog
    security.py     who may do what on the mesh, secrets     infra.py real NATS/Redis child processes
    stoprules.py    stop rules: predeclared bounds checked after every learner step
    tasks.py        task sources' sampler                    tokenizer.py a torch-free tokenizer view
    tool_calls.py   tool calls in the model's native format
    sandbox/        untrusted code in its own root, namespaces and limits, and its cgroups
    weights/        published weights on the shared volume (layout, the delta codec)
    run/            the `trajmesh` command line and a local run (the top layer: services never import it)

Imports: the core imports nothing of envs/, graders/, rollout/, learner/ or services/ (its plug-in
strings name them; tests/unit/repo/test_import_graph.py checks both).
"""
__version__ = "0.1.0"

import os as _os

# gRPC core's fork handlers off, before anything imports grpc (core reads this once, at import). Our
# processes fork children (engine servers, NATS/Redis, sandboxes) while their event loops are inside
# gRPC calls; with the handlers on, core skips or half-runs them and a child can die of SIGABRT or
# SIGSEGV before its exec (tests/unit/trajmesh/test_grpc_fork.py). No child of ours uses its
# parent's gRPC state, so nothing needs them. An explicit setting in the environment wins.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
