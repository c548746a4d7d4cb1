"""Build the demo's default policy (char tokenizer + tiny Llama + SFT warm start) and measure it.

    python examples/make_demo_model.py OUT_DIR [--seed 0] [--steps N]

Writes OUT_DIR/{tokenizer,init,sft}; OUT_DIR/sft is the warm start served as policy version 0.
Prints SFT time and held-out (256 problems) greedy accuracy, sampled (T=1) pass@1 and pass@8.
"""

from __future__ import annotations

import argparse
import json
import time

from trajmesh.config import DemoModelConfig
from trajmesh.envs import chain_sum
from trajmesh.learner.evaluate import evaluate
from trajmesh.learner.models import load_model, prepare_demo_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=DemoModelConfig().sft_steps, help="SFT steps")
    args = parser.parse_args()
    stats = prepare_demo_model(args.out_dir, args.seed, DemoModelConfig(sft_steps=args.steps))
    model, _ = load_model(stats["model_dir"])
    _, heldout = chain_sum.make_split(1, 256, **stats["knobs"])
    start = time.perf_counter()
    greedy = evaluate(model, stats["model_dir"], heldout, temperature=0.0, seed=1)
    sampled = evaluate(model, stats["model_dir"], heldout, temperature=1.0, samples=8, seed=2)
    report = {
        "params": stats["params"],
        "dims": stats["dims"],
        "knobs": stats["knobs"],
        "sft": stats["sft"],
        "sft_time_s": round(stats["time_s"], 1),
        "sft_tokens_per_s": round(stats["tokens_per_s"]),
        "sft_loss_first": round(stats["loss_first"], 4),
        "sft_loss_last": round(stats["loss_last"], 4),
        "heldout_greedy_pass1": greedy["pass_at_k"][1],
        "heldout_sampled_pass1": sampled["pass_at_k"][1],
        "heldout_sampled_pass8": sampled["pass_at_k"][8],
        "eval_time_s": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
