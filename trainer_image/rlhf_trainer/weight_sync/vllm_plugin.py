"""vLLM general plugin: keep linear weights on CPU so a second `load_weights` (weight sync) works.

On CPU, vLLM packs linear weights after loading and drops the originals (remove_weight=True); this
plugin swaps in a dispatcher that keeps them. It patches only that one module attribute, only on CPU.
"""

from __future__ import annotations

from typing import Any

_PATCHED_FLAG = "_rlhf_keeps_cpu_weights"


def register() -> None:
    """Entry point `vllm.general_plugins: rlhf_keep_cpu_weights`; idempotent, loaded in every vLLM process."""
    try:
        from vllm.platforms import current_platform
    except Exception:  # vLLM absent or broken: nothing to patch
        return
    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm
    if getattr(original, _PATCHED_FLAG, False):
        return

    def dispatch_keeping_weight(layer: Any, remove_weight: bool) -> None:
        del remove_weight
        original(layer, remove_weight=False)

    setattr(dispatch_keeping_weight, _PATCHED_FLAG, True)
    dispatch_keeping_weight.original = original  # type: ignore[attr-defined]
    # linear.py imports the name inside process_weights_after_loading, so patching the module
    # attribute is enough (and patching linear's namespace would not be).
    utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight
