"""Tiny ``transformers`` architectures and the harness that runs a diagnosis's fixes on copies
(tests/test_diagnose_real_models.py and tests/_diagnose_table.py).

Each case is a model built from a tiny config (2 layers, hidden size 32, vocabulary 99, batch 8,
sequence 16, random weights, fixed seeds: nothing is downloaded), an AdamW optimizer and the
inputs of one of three ways users write a step (``STYLES``). Dropout is off in every model as
built (see NOTE [ dropout off ]).

The harness: ``block_source`` reads the body of a function's ``with gs.record(...)`` block (the
user's step, the same text the diagnosis reads); ``run_step`` runs a step's text on a copy of the
user's objects under ``gs.record``, counted as the diagnosis counts its runs on CPU copies (see
``counted_as_the_diagnosis``); ``differences`` compares what two runs left
(gradients, parameters, optimizer state) within a tolerance; ``check_finding`` does all of it for
one finding and keeps a row for the table.
"""

from __future__ import annotations

import ast
import builtins
import copy
import inspect
import os
import re
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers as tf
from torch import nn

import gradscope as gs

tf.logging.set_verbosity_error()  # tiny configs make it warn about token ids and slow fallbacks

VOCAB, BATCH, SEQ, HIDDEN = 99, 8, 16, 32
FFN = 2 * HIDDEN
Objects = dict[str, Any]


# ----------------------------------------------------------------------------------------------
# the architectures (configs as in tests/test_real_models.py, at batch 8 and sequence 16: activations,
# not parameters and optimizer state, are most of a first step's peak, as in real training)
# ----------------------------------------------------------------------------------------------
def _ids(length: int = SEQ) -> torch.Tensor:
    return torch.randint(3, VOCAB, (BATCH, length))


def _images(size: int = 32) -> torch.Tensor:
    return torch.randn(BATCH, 3, size, size)


def _classes(n: int = 3) -> torch.Tensor:
    return torch.randint(0, n, (BATCH,))


def gpt2() -> tuple[nn.Module, Objects]:
    cfg = tf.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=32,
                        bos_token_id=1, eos_token_id=2)
    ids = _ids()
    return tf.GPT2LMHeadModel(cfg), {"batch": {"input_ids": ids, "labels": ids}}


def bert() -> tuple[nn.Module, Objects]:
    cfg = tf.BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=FFN, max_position_embeddings=32)
    ids = _ids()
    return tf.BertForMaskedLM(cfg), {"batch": {"input_ids": ids, "labels": ids}}


def bert_frozen() -> tuple[nn.Module, Objects]:
    """BERT with its embeddings and first layer frozen (``requires_grad_(False)``), as fine-tuning does."""
    model: Any
    model, objs = bert()
    model.bert.embeddings.requires_grad_(False)
    model.bert.encoder.layer[0].requires_grad_(False)
    return model, objs


def distilbert() -> tuple[nn.Module, Objects]:
    cfg = tf.DistilBertConfig(vocab_size=VOCAB, dim=HIDDEN, n_layers=2, n_heads=4, hidden_dim=FFN,
                              max_position_embeddings=32, num_labels=3)
    return tf.DistilBertForSequenceClassification(cfg), {"input_ids": _ids(), "labels": _classes()}


def t5() -> tuple[nn.Module, Objects]:
    cfg = tf.T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // 4, d_ff=FFN, num_layers=2, num_heads=4,
                      decoder_start_token_id=0, pad_token_id=0)
    return tf.T5ForConditionalGeneration(cfg), {"batch": {"input_ids": _ids(), "labels": _ids(8)}}


def bart() -> tuple[nn.Module, Objects]:
    cfg = tf.BartConfig(vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=FFN,
                        decoder_ffn_dim=FFN, max_position_embeddings=32)
    return tf.BartForConditionalGeneration(cfg), {"batch": {"input_ids": _ids(), "labels": _ids(8)}}


def _decoder(cfg_cls: Any, model_cls: Any) -> tuple[nn.Module, Objects]:
    cfg = cfg_cls(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return model_cls(cfg), {}


def llama() -> tuple[nn.Module, Objects]:
    model, _ = _decoder(tf.LlamaConfig, tf.LlamaForCausalLM)
    ids = _ids()
    return model, {"batch": {"input_ids": ids, "labels": ids}}


def llama_groups() -> tuple[nn.Module, Objects]:
    """LLaMA trained with two parameter groups (weight decay on matrices only), see ``optimizer``."""
    return llama()


def mistral() -> tuple[nn.Module, Objects]:
    model, _ = _decoder(tf.MistralConfig, tf.MistralForCausalLM)
    ids = _ids()
    return model, {"input_ids": ids, "labels": ids}


def qwen2() -> tuple[nn.Module, Objects]:
    model, _ = _decoder(tf.Qwen2Config, tf.Qwen2ForCausalLM)
    ids = _ids()
    return model, {"input_ids": ids, "labels": ids}


def vit() -> tuple[nn.Module, Objects]:
    cfg = tf.ViTConfig(image_size=16, patch_size=4, hidden_size=HIDDEN, num_hidden_layers=2,
                       num_attention_heads=4, intermediate_size=FFN, num_labels=3)
    return tf.ViTForImageClassification(cfg), {"pixel_values": _images(16), "labels": _classes()}


def clip() -> tuple[nn.Module, Objects]:
    text = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": 2,
            "num_attention_heads": 4, "max_position_embeddings": SEQ, "bos_token_id": 1, "eos_token_id": 2}
    vision = {"image_size": 16, "patch_size": 4, "hidden_size": HIDDEN, "intermediate_size": FFN,
              "num_hidden_layers": 2, "num_attention_heads": 4}
    model = tf.CLIPModel(tf.CLIPConfig(text_config=text, vision_config=vision, projection_dim=HIDDEN // 2))
    return model, {"batch": {"input_ids": _ids(), "pixel_values": _images(16), "return_loss": True}}


def whisper() -> tuple[nn.Module, Objects]:
    cfg = tf.WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, d_model=HIDDEN, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=FFN,
                           decoder_ffn_dim=FFN, max_source_positions=16, max_target_positions=16,
                           decoder_start_token_id=1, pad_token_id=0)
    batch = {"input_features": torch.randn(BATCH, 8, 32), "labels": _ids(8)}
    return tf.WhisperForConditionalGeneration(cfg), {"batch": batch}


def resnet() -> tuple[nn.Module, Objects]:
    cfg = tf.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=3)
    return tf.ResNetForImageClassification(cfg), {"pixel_values": _images(64), "labels": _classes()}


def convnext() -> tuple[nn.Module, Objects]:
    cfg = tf.ConvNextConfig(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=3)
    return tf.ConvNextForImageClassification(cfg), {"pixel_values": _images(64), "labels": _classes()}


def mobilenetv2() -> tuple[nn.Module, Objects]:
    cfg = tf.MobileNetV2Config(image_size=32, depth_multiplier=0.35, num_labels=3)
    return tf.MobileNetV2ForImageClassification(cfg), {"pixel_values": _images(32), "labels": _classes()}


# the ways a step is written (the test file has one block of each)
#   "batch":   out = model(**batch); loss = out.loss
#   "kwargs":  out = model(input_ids=input_ids, labels=labels); loss = out.loss
#   "loss_fn": out = model(pixel_values=pixel_values); loss = loss_fn(out.logits, labels)
STYLES: dict[str, tuple[Callable[[], tuple[nn.Module, Objects]], ...]] = {
    "batch": (gpt2, bert, bert_frozen, t5, bart, llama, llama_groups, clip, whisper),
    "kwargs": (distilbert, mistral, qwen2),
    "loss_fn": (vit, resnet, convnext, mobilenetv2),
}
ARCHS: dict[str, Callable[[], tuple[nn.Module, Objects]]] = {f.__name__: f for fs in STYLES.values() for f in fs}
STYLE_OF = {f.__name__: style for style, fs in STYLES.items() for f in fs}


# NOTE [ dropout off ]: a fix may draw random numbers in another order than the user's step
# (micro-batches, recomputation), so both copies run without dropout: p=0 on every nn.Dropout and 0.0
# in every float attribute whose name says dropout (the functional dropouts of BART, Whisper, CLIP
# and LLaMA's attention read those). It is off in the user's model as built too: with p > 0 the
# step saves dropout masks (10 % of GPT-2's peak here) that the copies would not, and the savings
# the diagnosis measured on the user's objects would not be the copies' savings.
def dropout_off(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
        for k, v in vars(m).items():
            if "dropout" in k.lower() and isinstance(v, float):
                setattr(m, k, 0.0)


def optimizer(arch: str, model: nn.Module) -> torch.optim.Optimizer:
    if arch == "llama_groups":  # weight decay on matrices, none on norms and biases
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                 lr=1e-3)
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def setup(arch: str) -> Objects:
    """The user's objects: ``model``, ``opt`` and the inputs its step style names."""
    torch.manual_seed(0)
    model: Any
    model, inputs = ARCHS[arch]()
    if model.config._attn_implementation not in ("eager", None):
        model.set_attn_implementation("eager")
    model.train()
    dropout_off(model)
    objs: Objects = {"model": model, "opt": optimizer(arch, model), **inputs}
    if STYLE_OF[arch] == "loss_fn":
        objs["loss_fn"] = nn.CrossEntropyLoss()
    return objs


# ----------------------------------------------------------------------------------------------
# the harness
# ----------------------------------------------------------------------------------------------
def block_source(fn: Callable[..., Any]) -> str:
    """The body of the first ``with gs.record(...)`` block in ``fn``, dedented, as written."""
    lines, _ = inspect.getsourcelines(fn)
    src = textwrap.dedent("".join(lines))
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.With) and any(
            isinstance(i.context_expr, ast.Call) and isinstance(i.context_expr.func, ast.Attribute)
            and i.context_expr.func.attr == "record" for i in node.items
        ):
            body = src.splitlines()[node.body[0].lineno - 1:node.body[-1].end_lineno]
            return textwrap.dedent("\n".join(body)) + "\n"
    raise AssertionError(f"{fn.__name__} has no `with gs.record(...)` block")


def counted_as_the_diagnosis() -> str:
    """The ``gs.record`` memory source that counts what the diagnosis counts on CPU copies: where the
    compiled hooks are in use, the CPU allocator's bytes (the diagnosis's counter of the allocator's reports; here the
    same reports through the profiler, ``memory="cpu"``: the kernels' own buffers too), else
    the tracker (see NOTE [ the CPU allocator counts a run ] in gradscope._analyses.diagnose.counts)."""
    from gradscope._capture import native as _native

    return "cpu" if os.environ.get("GRADSCOPE_NATIVE") != "0" and _native.counter() is not None else "tracker"


@dataclass
class Run:
    peak: int  # the step's peak allocated inside it, bytes (counted_as_the_diagnosis(), or the budget's tracker)
    ns: dict[str, Any]  # the names after the step ran
    resident: int = 0  # bytes of the objects' tensors when the step started (each storage once)


def _tensors(v: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        yield v
    elif isinstance(v, nn.Module):
        for t in (*v.parameters(), *v.buffers()):
            yield t
            if t.grad is not None:
                yield t.grad
    elif isinstance(v, torch.optim.Optimizer):
        for st in v.state.values():
            yield from (t for t in st.values() if isinstance(t, torch.Tensor))
    elif depth < 2 and isinstance(v, dict):
        for x in v.values():
            yield from _tensors(x, depth + 1)
    elif depth < 2 and isinstance(v, list | tuple):
        for x in v:
            yield from _tensors(x, depth + 1)


def resident_bytes(objs: Objects) -> int:
    """Bytes of the tensors the objects hold (parameters, buffers, gradients, optimizer state,
    inputs), each storage once: what exists before a step, outside its peak."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for v in objs.values() for t in _tensors(v) if t.device.type != "meta"}
    return sum(storages.values())


def run_step(code: str, objs: Objects, *, seed: int = 0, budget: int | None = None) -> Run:
    """Run ``code`` with ``objs`` (already copies) bound, ``torch`` importable, under a budget's tracker
    where ``budget`` is given, else counted as the diagnosis counts (``counted_as_the_diagnosis``)."""
    ns: dict[str, Any] = {"__builtins__": builtins, "__name__": "__gradscope_step__", "torch": torch, **objs}
    resident = resident_bytes(objs)
    torch.manual_seed(seed)
    with gs.record(memory="tracker" if budget is not None else counted_as_the_diagnosis(), budget=budget) as rec:
        exec(compile(code, "<step>", "exec"), ns)
    r = rec.recording
    assert r is not None
    return Run(int(r.peak_bytes), ns, resident)


def take_step(code: str, objs: Objects) -> None:
    """Run a step on the objects themselves, unrecorded (a loop's earlier step)."""
    exec(compile(code, "<step>", "exec"), {"__builtins__": builtins, "torch": torch, **objs})


def copies(snapshot: Objects) -> Objects:
    """A fresh deep copy of the objects (one dict, so the optimizer's parameters are the copied
    model's), with dropout off (see NOTE [ dropout off ])."""
    c = copy.deepcopy(snapshot)
    dropout_off(c["model"])
    return c


def _optimizers(v: Any, depth: int = 0) -> Iterator[torch.optim.Optimizer]:
    if isinstance(v, torch.optim.Optimizer):
        yield v
    elif depth < 2 and isinstance(v, dict):
        for x in v.values():
            yield from _optimizers(x, depth + 1)
    elif depth < 2 and isinstance(v, list | tuple):
        for x in v:
            yield from _optimizers(x, depth + 1)


def optimizer_state(ns: dict[str, Any], p: torch.Tensor) -> dict[str, Any]:
    """The state kept for parameter ``p`` by the optimizers bound in ``ns`` (a fix may make its own,
    one per parameter for a step in backward): of those that hold some, the one that stepped most."""
    states = [o.state[p] for v in ns.values() for o in _optimizers(v) if o.state.get(p)]
    return max(states, key=lambda s: float(s.get("step", 0)), default={})


@dataclass(frozen=True)
class Tolerance:
    rtol: float = 1e-4
    atol: float = 1e-6  # times the largest magnitude in the reference tensor
    floor: float = 0.0  # an absolute bound below which differences are not counted

    def close(self, got: torch.Tensor, want: torch.Tensor) -> str | None:
        """None where ``got`` matches ``want``, else what differs."""
        if got.shape != want.shape:
            return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
        got, want = got.detach().double(), want.detach().double()
        scale = float(want.abs().max()) if want.numel() else 0.0
        err = (got - want).abs() - (max(self.atol * scale, self.floor) + self.rtol * want.abs())
        if want.numel() and float(err.max()) > 0:
            return f"max |diff| {float((got - want).abs().max()):.3g} (largest |value| {scale:.3g})"
        return None


DEFAULT_TOLERANCE = Tolerance()


def tolerance_stated(message: str) -> Tolerance | None:
    """The tolerance a finding's message states (``rtol=1e-2, atol=1e-3``, or ``within 1e-2``)."""
    rtol = re.search(r"rtol\s*[=:]?\s*([0-9.]+(?:e-?[0-9]+)?)", message)
    atol = re.search(r"atol\s*[=:]?\s*([0-9.]+(?:e-?[0-9]+)?)", message)
    if rtol or atol:
        return Tolerance(float(rtol.group(1)) if rtol else 0.0, float(atol.group(1)) if atol else 0.0)
    within = re.search(r"(?:within|tolerance(?: of)?)\s+([0-9.]+(?:e-?[0-9]+)?)\s*(%?)", message)
    if within:
        v = float(within.group(1)) / (100 if within.group(2) else 1)
        return Tolerance(v, v)
    return None


def is_autocast(f: Any) -> bool:
    return re.search(r"autocast|bfloat16|float16|\bamp\b", f"{f.pattern} {f.code}", re.IGNORECASE) is not None


# NOTE [ parameters after an Adam step ]: Adam moves each element by about lr * m / (sqrt(v) + eps),
# so an element whose gradients are near zero (a zero-initialised bias in its first steps) moves by
# an amount that float32 reordering of its gradient (checkpointing's recompute, micro-batches)
# changes at the scale of lr, not of the parameter: 6.5e-8 measured on GPT-2's c_attn.bias (largest
# value 0.003) with lr 1e-3. Parameters are compared with an absolute floor of 1e-3 * lr on top;
# a step that changes the gradients themselves (GPT-2's micro-batch losses left unscaled) moved
# them by 3.4e-4, and the optimizer's moments are compared without the floor.
def differences(a: Run, b: Run, tol: Tolerance) -> list[str]:
    """What the step left in copy B that differs from copy A: gradients (None reads as zeros),
    parameters after the step (see NOTE [ parameters after an Adam step ]), optimizer state (per
    parameter, by position)."""
    out: list[str] = []
    lrs = [float(g["lr"]) for v in a.ns.values() for o in _optimizers(v) for g in o.param_groups]
    param_tol = Tolerance(tol.rtol, tol.atol, max(tol.floor, 1e-3 * max(lrs, default=0.0)))
    params_a = dict(a.ns["model"].named_parameters())
    params_b = dict(b.ns["model"].named_parameters())
    assert params_a.keys() == params_b.keys()
    for name, pa in params_a.items():
        pb = params_b[name]
        ga, gb = pa.grad, pb.grad
        if ga is not None or gb is not None:
            ga = torch.zeros_like(pa) if ga is None else ga
            gb = torch.zeros_like(pb) if gb is None else gb
            if (why := tol.close(gb, ga)) is not None:
                out.append(f"{name}.grad: {why}")
        if (why := param_tol.close(pb, pa)) is not None:
            out.append(f"{name}: {why}")
        sa, sb = optimizer_state(a.ns, pa), optimizer_state(b.ns, pb)
        if sa.keys() != sb.keys():
            out.append(f"optimizer state of {name}: keys {sorted(sa)} != {sorted(sb)}")
            continue
        for k, va in sa.items():
            vb = sb[k]
            if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor):
                why = tol.close(vb.float(), va.float())
            else:
                why = None if va == vb else f"{vb!r} != {va!r}"
            if why is not None:
                out.append(f"optimizer state {k!r} of {name}: {why}")
    return out


SMALL = 64 * 1024  # a claim counts as met within 10 % or within this many bytes


@dataclass
class Row:
    """One finding with code, run on copies: what the table prints and the test asserts."""

    arch: str
    pattern: str
    claimed: int | None
    peak_before: int | None
    peak_after: int | None
    fits: bool | None
    user_peak: int = 0  # copy A: the user's step
    fix_peak: int = 0  # copy B: the finding's code
    resident: int = 0  # copy A's tensors before its step (for the table)
    error: str | None = None  # what the fix's code raised
    mismatches: list[str] = field(default_factory=list)

    @property
    def measured(self) -> int:
        return self.user_peak - self.fix_peak


@dataclass
class BudgetRow:
    """One diagnosis under a budget: each finding with code, whether it says it fits, and what
    running the code of those that fit under the budget gave (None: not run; "ok"; the error)."""

    arch: str
    later: bool  # the optimizer had state before the step (a later step of a loop), else the first step
    budget: int
    peak: int  # the step's unbudgeted peak
    findings: list[tuple[str, bool | None, str | None]] = field(default_factory=list)


TABLE: list[Row] = []  # every row checked in this process, for tests/_diagnose_table.py
BUDGET_TABLE: list[BudgetRow] = []


def check_finding(arch: str, f: Any, snapshot: Objects, user_step: str, a: Run | None = None) -> Row:
    """Copy A runs the user's step (or ``a`` is that run, done once for several findings), copy B
    the finding's code verbatim (same seed, dropout off)."""
    row = Row(arch, f.pattern, f.saves_bytes, getattr(f, "peak_before", None), getattr(f, "peak_after", None),
              getattr(f, "fits", None))
    TABLE.append(row)
    a = a or run_step(user_step, copies(snapshot))
    row.user_peak, row.resident = a.peak, a.resident
    try:
        b = run_step(f.code, copies(snapshot))
    except Exception as e:
        row.error = f"{type(e).__name__}: {e}"
        return row
    row.fix_peak = b.peak
    # the tolerance the finding states (its field, else its message); an autocast finding must state one
    given = getattr(f, "tolerance", None)
    tol: Tolerance | None = DEFAULT_TOLERANCE
    if given is not None:
        tol = Tolerance(given, given)
    elif is_autocast(f):
        tol = tolerance_stated(f.message)
    if tol is None:
        row.mismatches.append(f"an autocast finding that states no tolerance: {f.message!r}")
        return row
    row.mismatches = differences(a, b, tol)
    return row
