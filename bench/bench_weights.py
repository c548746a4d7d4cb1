"""Weight sync: full checkpoints versus deltas (`weights.sync`), side by side in one run.

A Qwen2-architecture model (random init, ≥ 100M parameters, fp32 master weights, published in
bf16 as the learner's bf16 precision does) is trained for ``--steps`` real AdamW steps at each RL
learning rate in ``--lrs`` (a causal-LM loss on random tokens), from the same init. After every
step, version by version:

* **full** (``weights.sync: full``): the safetensors export (``export_policy``) written to the
  "shared volume" directory, then read back whole (``safetensors.torch.load_file``, the engine's
  read): raw write + read of the checkpoint's bytes;
* **delta** (``weights.sync: delta``): the same export through a ``DeltaWriter`` (only the changed
  tensors, each in the smallest of its encodings, trajmesh/weights/delta.py; an anchor every
  ``--anchor-every`` versions), then a rollout's
  ``LocalWeights.prepare`` (rebuild on local disk from its previous copy, the file's sha256 checked
  as it is written), then the same engine read of the rebuilt file: publish → loaded.

Printed per version: weight bytes written to the volume (full vs delta, = what each pod reads), the
two latencies and their ratio, how many tensors each encoding carried; then the goals (delta bytes ≤ 10 % of full at lr ≤ 1e-5, delta
latency ≤ 1.5× raw I/O of the same bytes) stated met or not, and an extrapolation to 1.5B / 7B /
32B parameters from the measured changed-byte fraction (an extrapolation, not a measurement).
`--shape 1.5B --device cuda` trains Qwen2.5-1.5B's shape on a GPU instead (the publish and
rebuild stay on the CPU, as on a pod). Every file here lives on one local disk and mostly in the page cache: the raw I/O is the fastest
a volume could be, so the latency ratio is the worst case for deltas.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from trajmesh.learner.weights import export_policy
from trajmesh.weights.delta import DELTA_NAME, MANIFEST_NAME, SAFETENSORS_NAME, DeltaWriter, LocalWeights
from trajmesh.weights.layout import temp_dir_name, version_dir_name

BYTES_GOAL = 0.10
LATENCY_GOAL = 1.5
EXTRAPOLATE = {"1.5B": 1.5e9, "7B": 7.6e9, "32B": 32.8e9}
PODS = 32


SHAPES = {
    # ~125M parameters (GQA, SwiGLU, untied head): what a 2-core, 24 GiB machine trains in seconds.
    "125M": {"vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
             "num_attention_heads": 12, "num_key_value_heads": 4, "tie_word_embeddings": False},
    # Qwen2.5-1.5B's published shape (1.54B parameters, tied embeddings); needs a GPU to train quickly.
    "1.5B": {"vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
             "num_attention_heads": 12, "num_key_value_heads": 2, "tie_word_embeddings": True},
}


def build_model(seed: int, shape: str = "125M", device: str = "cpu") -> Qwen2ForCausalLM:
    """A Qwen2-architecture model of `shape` (SHAPES), random init, fp32 master weights, on `device`."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096)
    with torch.device(device):
        return Qwen2ForCausalLM(cfg).float()


def _weight_bytes(d: Path) -> int:
    return sum((d / n).stat().st_size for n in (SAFETENSORS_NAME, DELTA_NAME) if (d / n).exists())


def _full_version(model: torch.nn.Module, volume: Path, v: int) -> dict[str, Any]:
    start = time.perf_counter()
    d = volume / f"full-v{v:06d}"
    export_policy(model, d, dtype=torch.bfloat16)
    write_s = time.perf_counter() - start
    load_file(str(d / SAFETENSORS_NAME))
    return {"bytes": _weight_bytes(d), "write_s": write_s, "total_s": time.perf_counter() - start, "dir": d}


def _delta_version(model: torch.nn.Module, volume: Path, v: int, writer: DeltaWriter,
                   pod: LocalWeights) -> dict[str, Any]:
    start = time.perf_counter()
    tmp = volume / temp_dir_name(v)
    export_policy(model, tmp, dtype=torch.bfloat16, delta=writer, version=v)
    final = volume / version_dir_name(v)
    os.replace(tmp, final)
    writer.commit(final.name)
    publish_s = time.perf_counter() - start
    local = pod.prepare(final)
    rebuild_s = time.perf_counter() - start - publish_s
    load_file(str(local / SAFETENSORS_NAME))
    pod.loaded(local)
    total_s = time.perf_counter() - start
    tensors = json.loads((final / MANIFEST_NAME).read_text())["tensors"]
    encodings = collections.Counter(t["delta"]["enc"] if "delta" in t else "unchanged" for t in tensors)
    return {"bytes": _weight_bytes(final), "anchor": (final / SAFETENSORS_NAME).exists(), "publish_s": publish_s,
            "rebuild_s": rebuild_s, "total_s": total_s, "local": local, "encodings": dict(sorted(encodings.items()))}


def run_lr(lr: float, steps: int, anchor_every: int, root: Path, seed: int, shape: str = "125M",
           device: str = "cpu", batch: tuple[int, int] = (1, 32), threads: int = 4) -> list[dict[str, Any]]:
    model = build_model(seed, shape, device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    volume, full_volume = root / f"volume-{lr:g}", root / f"full-{lr:g}"
    volume.mkdir()
    full_volume.mkdir()
    writer, pod = DeltaWriter(anchor_every, threads=threads), LocalWeights(root / f"pod-{lr:g}", threads=threads)
    rows = []
    for v in range(1, steps + 1):
        ids = torch.randint(0, model.config.vocab_size, batch, generator=gen).to(device)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        step_s = time.perf_counter() - t0
        full = _full_version(model, full_volume, v)
        delta = _delta_version(model, volume, v, writer, pod)
        same = (full["dir"] / SAFETENSORS_NAME).read_bytes() == (delta["local"] / SAFETENSORS_NAME).read_bytes()
        assert same, f"lr {lr:g} v{v}: the rebuilt checkpoint is not the full export"
        shutil.rmtree(full["dir"])
        rows.append({"lr": lr, "version": v, "anchor": delta["anchor"], "full_bytes": full["bytes"],
                     "delta_bytes": delta["bytes"], "delta_over_full_bytes": delta["bytes"] / full["bytes"],
                     "raw_write_read_s": round(full["total_s"], 3), "raw_write_s": round(full["write_s"], 3),
                     "delta_publish_s": round(delta["publish_s"], 3), "delta_rebuild_s": round(delta["rebuild_s"], 3),
                     "delta_publish_to_loaded_s": round(delta["total_s"], 3),
                     "latency_ratio": round(delta["total_s"] / full["total_s"], 3), "train_step_s": round(step_s, 2),
                     "bitwise_equal": same, "tensors_by_encoding": delta["encodings"]})
    return rows


def _extrapolation(fraction: float, anchor_every: int) -> list[dict[str, Any]]:
    """Bytes through the volume per version at other sizes, bf16, from the measured fraction of
    bytes a delta version writes (an extrapolation: the fraction is assumed size-independent)."""
    out = []
    for name, params in EXTRAPOLATE.items():
        full_gb = params * 2 / 1e9
        per_version = full_gb * ((anchor_every - 1) * fraction + (1 + fraction)) / anchor_every  # anchors amortized
        out.append({"model": name, "full_GB_per_version": round(full_gb, 1),
                    "delta_GB_per_version_amortized": round(per_version, 2),
                    f"full_GB_through_volume_{PODS}_pods": round(full_gb * (1 + PODS), 1),
                    f"delta_GB_through_volume_{PODS}_pods": round(per_version + PODS * full_gb * fraction, 1)})
    return out


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (= versions) per learning rate")
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    p.add_argument("--anchor-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None, help="where the volume and the pod's disk go (default: a temp dir)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="125M", help="model shape (SHAPES)")
    p.add_argument("--device", default="cpu", help="where the model trains (cuda for the 1.5B shape)")
    p.add_argument("--threads", type=int, default=4, help="encode / rebuild threads (DeltaWriter, LocalWeights)")
    p.add_argument("--batch", type=int, nargs=2, default=[1, 32], metavar=("SEQS", "TOKENS"),
                   help="random-token sequences per step and their length")
    args = p.parse_args(argv)
    with torch.device("meta"):
        params = sum(t.numel() for t in build_model(args.seed, args.shape, "meta").parameters())
    print(json.dumps({"model": f"Qwen2 {args.shape} shape (random init)", "parameters": params,
                      "device": args.device, "batch": args.batch, "threads": args.threads, "publish_dtype": "bf16",
                      "steps_per_lr": args.steps, "anchor_every": args.anchor_every, "cpus": os.cpu_count(),
                      "load_avg_1m_at_start": os.getloadavg()[0]}), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-weights-", dir=args.dir) as tmp:
        rows = []
        for lr in args.lrs:
            sub = Path(tmp) / f"lr-{lr:g}"
            sub.mkdir()
            for row in run_lr(lr, args.steps, args.anchor_every, sub, args.seed, args.shape, args.device,
                              tuple(args.batch), args.threads):
                print(json.dumps(row), flush=True)
                rows.append(row)
    summary: dict[str, Any] = {}
    for lr in args.lrs:
        deltas = [r for r in rows if r["lr"] == lr and not r["anchor"]]
        if not deltas:
            continue
        summary[f"lr_{lr:g}"] = {
            "delta_over_full_bytes_median": round(statistics.median(r["delta_over_full_bytes"] for r in deltas), 4),
            "latency_ratio_median": round(statistics.median(r["latency_ratio"] for r in deltas), 3),
            "raw_write_read_s_median": statistics.median(r["raw_write_read_s"] for r in deltas),
            "delta_publish_to_loaded_s_median": statistics.median(r["delta_publish_to_loaded_s"] for r in deltas)}
    print(json.dumps({"summary_delta_versions": summary, "load_avg_1m_at_end": os.getloadavg()[0]}), flush=True)
    for key, cell in summary.items():
        b, lat = cell["delta_over_full_bytes_median"], cell["latency_ratio_median"]
        print(f"{key}: goal delta bytes <= {BYTES_GOAL:.0%} of full: {'met' if b <= BYTES_GOAL else 'NOT met'} "
              f"(median {b:.1%}); goal delta publish->loaded <= {LATENCY_GOAL}x raw write+read: "
              f"{'met' if lat <= LATENCY_GOAL else 'NOT met'} (median {lat:.2f}x)")
    fraction = max(s["delta_over_full_bytes_median"] for s in summary.values())
    print(f"EXTRAPOLATION (not measured): bf16, the measured worst delta fraction {fraction:.1%}, an anchor "
          f"every {args.anchor_every} versions, {PODS} pods each reading every version once")
    for line in _extrapolation(fraction, args.anchor_every):
        print(json.dumps(line))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
