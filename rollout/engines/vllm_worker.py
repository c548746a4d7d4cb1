"""A vLLM worker extension (``--worker-extension-cls vllm_worker.WeightReloadExtension``) that the
`vllm` rollout engine (rollout/engines/vllm_engine.py) calls after each in-place ``reload_weights``.

It runs inside vLLM's worker process, from the vLLM venv's interpreter: it imports nothing from
trajmesh (the engine puts this file's directory on the server's PYTHONPATH), only torch.

Why it exists: vLLM's CPU backend packs each linear layer's weight for its GEMM kernel once, in
``process_weights_after_loading``. A tied ``lm_head`` has no tensor of its own in the checkpoint, so
``reload_weights`` writes the new embedding but never re-packs the head: the model keeps producing
logits from the old head. `retie_lm_head` ties the head to the (reloaded) embedding again and re-runs
the head's ``process_weights_after_loading``, which rebuilds the packed copy.
"""

from __future__ import annotations

from typing import Any


class WeightReloadExtension:
    """Mixed into vLLM's worker class; ``self.model_runner`` is the worker's model runner."""

    model_runner: Any

    def retie_lm_head(self) -> str:
        """Re-ties a tied ``lm_head`` to the input embedding and re-packs it; returns what it did
        ("retied", or "untied" for a model whose head has its own weights: nothing to do)."""
        model = self.model_runner.get_model()
        config = getattr(model, "config", None)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        head = getattr(model, "lm_head", None)
        inner = getattr(model, "model", None)
        embed = getattr(inner, "embed_tokens", None)
        if not tied or head is None or embed is None:
            return "untied"
        head.weight = embed.weight
        method = getattr(head, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(head)
        return "retied"
