"""The learner's machinery (torch): what a step trains on, how it updates, and weights out.

    recipe.py       what one step trains on, a pure function of the batch and the config
    advantages.py   advantage estimators, and a batch's advantages (GiGPO, distillation's term)
    step.py         one step: the staleness check, the batch's tensors, loss, micro-batched update
    objective.py    decoupled PPO with behavior correction; the reference KL
    logprobs.py     token log-probs and entropy, chunked         microbatch.py token-budget micro-batches
    metrics.py      per-step metrics that reveal mechanism       shaping.py reward shaping, truncation, MAGIC
    consistency.py  the engine-consistency probe                 reference.py the frozen reference policy
    train_engine.py the optimizer side (plain torch, DeepSpeed)  heap.py malloc_trim after a step
    weights.py      weights out as safetensors, streamed         checkpoint_compat.py old checkpoints
    evaluate.py     held-out evaluation through the rollout's episode layout
    prm.py          PRIME's implicit process reward model, trained online beside the policy
    models.py       the demo model and its character tokenizer   simulated.py the benchmarks' modelled step

Imports: the core, envs/, graders/ and rollout/; never services/ (the learner service wires it).
"""
