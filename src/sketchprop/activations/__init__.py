r"""Compact activations: what backward keeps besides the linear layers' inputs, one module per part.

A transformer encoder saves more for backward than its linear inputs: the attention core (softmax
output, dropped probabilities, Q, K, V), the dropout masks (a float per element on CPU) and the
GELU inputs. A decoder fine-tuned with LoRA saves for backward mostly what its elementwise code
keeps: the SiLU-gated MLP keeps SiLU's input, its output and both factors of the product; an
RMSNorm written as Python ops keeps its input, its float32 normalised input and the product; the
loss keeps the log-probabilities of every token over the whole vocabulary. Each has a leaner form,
here as drop-in replacements that :func:`sketchprop.patch_activations` puts into a model (each
part the model has); each module's docstring says what its part keeps and why:

- :mod:`~sketchprop.activations.dropout`: :class:`SeededDropout`, :class:`PackedDropout`
  (``dropout=``).
- :mod:`~sketchprop.activations.attention`: :func:`recompute_attention` (``attention=``), and
  :class:`CodeAttentionInput` (``attention="coded"``); which models it stands in for:
  :mod:`~sketchprop.activations.attention_models`.
- :mod:`~sketchprop.activations.gelu`: :class:`CompactGELU`, :class:`CompactTanhGELU` and their
  codes, :class:`GeluCode` (``gelu_bits=``, ``gelu_code=``).
- :mod:`~sketchprop.activations.norms`: :class:`OutputLayerNorm`, :class:`CodedLayerNorm`
  (``layernorm=``),
  :class:`RMSNormFunction`, :class:`CodedRMSNorm` (``rmsnorm=``).
- :mod:`~sketchprop.activations.mlp`: the gated MLP's forwards (SiLU or GELU gate, separate or
  fused gate and up, found by :func:`gated_layout`), :class:`CodedGatedMLP` (``mlp=``).
- :mod:`~sketchprop.activations.experts`: a mixture of experts held as stacked parameters, made
  again in backward from its input or a code of it, :class:`CodedExperts` (``experts=``); the
  module made again, :class:`RecomputedModule` (:mod:`~sketchprop.activations.recompute`), also
  takes an attention block of its own (DeBERTa's) under ``attention="coded"``.
- :mod:`~sketchprop.activations.loss`: :func:`chunked_lm_loss` (``lm_loss=``).
- :mod:`~sketchprop.activations.floor`: :class:`Floor` (``floor_bits=``): whatever the parts
  above leave, on any model, as one b-bit code per saved storage.
- shared by several parts: :mod:`~sketchprop.activations.seeds` (seeds and dropout masks),
  :mod:`~sketchprop.activations.projections` (projections made again in backward),
  :mod:`~sketchprop.activations.qkv` (which projections make an attention block's Q, K, V),
  :mod:`~sketchprop.activations.rows` (the rows the attention's backward reads, checked), and, with
  the b-bit codes of :mod:`sketchprop.quantize`, :mod:`sketchprop.packing` (bit packing).

**Eval mode.** Dropout is off and :class:`CompactGELU` is the exact GELU (it keeps its input):
gradients taken in eval mode (saliency, say) are the plain model's, and deterministic.
"""

from ..packing import pack_codes, unpack_codes
from .attention import (
    ATTENTION,
    ATTENTION_NAME,
    CodeAttentionInput,
    drop_attention_input,
    forget_attention_check,
    keep_attention_input,
    recompute_attention,
    register_attention,
)
from .dropout import DROPOUT, PackedDropout, SeededDropout
from .experts import EXPERTS, CodedExperts, is_experts
from .floor import Floor
from .gelu import (
    DEFAULT_GELU_BITS,
    DEFAULT_GELU_CODE,
    GELU_CODES,
    CompactGELU,
    CompactTanhGELU,
    GeluCode,
    _CompactGeluFunction,  # noqa: F401  (scripts/gelu_bits.py applies it directly)
    gelu_derivative,
    gelu_tanh_derivative,
    is_exact_gelu,
    is_tanh_gelu,
)
from .loss import LMLossForward, chunked_lm_loss, lm_loss_refusal
from .mlp import (
    GATES,
    CodedGatedMLP,
    GatedDown,
    GatedFromInput,
    GatedLayout,
    GateProduct,
    frozen_projections,
    gate_of,
    gated_layout,
    gated_mlp_auto_forward,
    gated_mlp_forward,
    gated_mlp_input_forward,
    is_gated_mlp,
    is_plain_mlp,
    keeps_input,
    takes_mlp,
)
from .norms import (
    LAYERNORM,
    CodedLayerNorm,
    CodedRMSNorm,
    OutputLayerNorm,
    RMSNormFunction,
    is_layernorm,
    is_rms_norm,
    rms_norm_form,
    rms_norm_forward,
)
from .qkv import has_projections, has_rope_projections, is_attention_block, is_own_attention, takes_rope
from .recompute import RecomputedModule
from .seeds import keep_mask

__all__ = [
    "ATTENTION",
    "ATTENTION_NAME",
    "CodeAttentionInput",
    "CodedExperts",
    "CodedGatedMLP",
    "CodedLayerNorm",
    "CodedRMSNorm",
    "DEFAULT_GELU_BITS",
    "DEFAULT_GELU_CODE",
    "DROPOUT",
    "EXPERTS",
    "Floor",
    "GELU_CODES",
    "LAYERNORM",
    "CompactGELU",
    "CompactTanhGELU",
    "GatedDown",
    "GatedFromInput",
    "GeluCode",
    "LMLossForward",
    "OutputLayerNorm",
    "PackedDropout",
    "RMSNormFunction",
    "RecomputedModule",
    "SeededDropout",
    "GATES",
    "GatedLayout",
    "GateProduct",
    "chunked_lm_loss",
    "drop_attention_input",
    "forget_attention_check",
    "frozen_projections",
    "gated_mlp_auto_forward",
    "gated_mlp_forward",
    "gated_mlp_input_forward",
    "gelu_derivative",
    "gelu_tanh_derivative",
    "has_projections",
    "has_rope_projections",
    "is_attention_block",
    "is_own_attention",
    "takes_mlp",
    "takes_rope",
    "is_exact_gelu",
    "is_experts",
    "gate_of",
    "gated_layout",
    "is_gated_mlp",
    "is_plain_mlp",
    "is_layernorm",
    "is_rms_norm",
    "rms_norm_form",
    "is_tanh_gelu",
    "keep_attention_input",
    "keep_mask",
    "keeps_input",
    "lm_loss_refusal",
    "pack_codes",
    "recompute_attention",
    "register_attention",
    "rms_norm_forward",
    "unpack_codes",
]
