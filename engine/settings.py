"""Every user-facing setting, declared once.

One table of :class:`Setting` records (in the spirit of llama.cpp's ``common/arg.cpp`` option
table and GPT4All's ``MySettings``). Everything else is derived from it:

- :class:`EngineConfig` (the engine's runtime settings: fields, defaults, ``validated()``) and
  :class:`SamplingParams` (how the next token is chosen), both frozen dataclasses;
- the one validation (:func:`validate`), used by ``EngineConfig.validated``, the Sampler, the
  settings file and the settings dialog;
- the ``colibri run`` flags (engine.cli): flag ``--a-b`` for the setting ``a_b``, the same
  name as the settings-file key;
- the app's settings file (colibri_app/settings_store.py: keys, which changes reopen the model);
- the settings dialog's widgets (colibri_app/settings_dialog.py: kind, range, unit, tooltip).

To add a setting: add one ``Setting(...)`` to ENGINE_SETTINGS (or SAMPLING_SETTINGS) and read
it where the engine uses it (``config.<name>``). Nothing else needs editing.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, field, fields, make_dataclass, replace
from typing import Any

from .cache.registry import POLICY_CLASSES
from .errors import ConfigError
from .speculative import SPECULATION_MODES

POLICIES = tuple(POLICY_CLASSES)  # the cache's eviction policies, by registered name
CHECKSUM_MODES = ("off", "first", "always")
KV_DTYPES = ("f16", "f32")  # KV cache element (engine.models.base.KV_DTYPES, engine.sizing.KV_ELEMENT_BYTES)

ENGINE = "engine"      # speed and memory: never the generated tokens (context_length: what fits in them)
SAMPLING = "sampling"  # how the next token is chosen (applies to the next message)
APP = "app"            # the desktop app's own look (no engine effect; no `colibri run` flag)
THEMES = ("system", "light", "dark")


@dataclass(frozen=True)
class Setting:
    """One setting.

    Attributes:
        name: the field name, settings-file key and (with dashes) the ``colibri run`` flag.
        type: int, float, bool or str.
        default: the default value (None only with ``auto``).
        help: what it does (CLI help and dialog tooltip).
        label: the dialog's label.
        group: ENGINE, SAMPLING or APP (the dataclass it belongs to).
        lo, hi: inclusive range of numbers (``lo_open``: lo itself excluded).
        choices: allowed values (str or int settings); ``choice_labels``: how the dialog
            shows them.
        unit: the unit after a number ("GB", "tokens", "threads" ...); plural, the dialog
            drops the "s" for 1.
        special: what ``lo`` means when it is a special value ("all cores", "off" ...).
        auto: None is allowed and means "the engine decides" (cap, RAM budget).
        needs_reload: a change reopens the model.
        needs_pilot: meaningful only with PILOT on (the dialog disables it when pilot is 0).
        check_text: the dialog's checkbox text (bool settings).
        decimals, step: the dialog's spin box for floats / ints.
        old_names: earlier settings-file keys still accepted when reading.
    """

    name: str
    type: type
    default: Any
    help: str
    label: str
    group: str = ENGINE
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    choices: tuple = ()
    choice_labels: tuple = ()
    unit: str = ""
    special: str = ""
    auto: bool = False
    needs_reload: bool = True
    needs_pilot: bool = False
    check_text: str = ""
    decimals: int = 2
    step: float = 1
    old_names: tuple = ()

    @property
    def flag(self) -> str:
        """The ``colibri run`` flag: ``--`` + name with dashes."""
        return "--" + self.name.replace("_", "-")

    def range_text(self) -> str:
        """The valid values in words ("1–8 threads", "one of lru, lfru, ema", "(0–1]", ...)."""
        if self.type is bool:
            return "on or off"
        if self.choices:
            return "one of " + ", ".join(str(c) for c in self.choices)
        if self.lo is None and self.hi is None:
            return "any"
        lo = "-inf" if self.lo is None else _num_text(self.lo)
        hi = "inf" if self.hi is None else _num_text(self.hi)
        unit = f" {self.unit}" if self.unit else ""
        s = f"({lo}–{hi}]" if self.lo_open else f"{lo}–{hi}"
        s += unit
        if self.special and not self.lo_open:
            s += f" ({lo} = {self.special})"
        if self.auto:
            s += ", or auto"
        return s

    def check(self, value: Any) -> Any:
        """Return ``value`` (ints as int, floats as float) if valid.

        Raises:
            ConfigError: naming the setting, the value and the valid range.
        """
        def bad(why: str):
            raise ConfigError(f"setting '{self.name}' = {value!r}: {why}")

        if value is None:
            if self.auto:
                return None
            bad(f"must be {self.range_text()}")
        if self.type is bool:
            if not isinstance(value, bool):
                bad("must be true or false")
            return value
        if self.type is str:
            if not isinstance(value, str) or (self.choices and value not in self.choices):
                bad(f"must be {self.range_text()}")
            return value
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            bad(f"must be a number, got {type(value).__name__}")
        if self.type is int:
            if isinstance(value, numbers.Integral):
                v = int(value)
            elif math.isfinite(value) and float(value).is_integer():
                v = int(value)
            else:
                bad("must be a whole number")
        else:
            v = float(value)
            if not math.isfinite(v):
                bad("must be a finite number" + (f" in {self.range_text()}" if self.lo is not None or self.hi is not None else ""))
        if self.choices and v not in self.choices:
            bad(f"must be {self.range_text()}")
        too_low = self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo)
        if too_low or (self.hi is not None and v > self.hi):
            bad(f"is out of range {self.range_text()}")
        return v


def _num_text(v: float) -> str:
    """A range end as text: whole numbers in full (1048576, not 1.04858e+06)."""
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


def _S(*args, **kw) -> Setting:
    return Setting(*args, **kw)


PILOT_MODES = ("0 – off (load experts on demand only)", "1 – predict the next layer",
               "2 – predict the next 2 layers", "3 – predict the next 3 layers")

ENGINE_SETTINGS: tuple[Setting, ...] = (
    _S("pilot", int, 0, "PILOT router-lookahead prefetch: load the experts the next layers will probably need "
       "while the current layer computes (0 = off: on the machines measured so far, prefetch read more "
       "than it saved)", "PILOT prefetch", choices=(0, 1, 2, 3), choice_labels=PILOT_MODES),
    _S("pilot_draft", bool, True, "while a decode step waits for experts that were not in RAM, predict the "
       "next layer from the draft residual (the layer's output with the missing experts left out, through the "
       "next layer's attention) and queue its likely misses behind the read, when the wait is longer than the "
       "draft takes; a draft is far closer to the next layer's input than the residual "
       "PILOT predicts from otherwise", "Draft lookahead",
       check_text="predict from the partial layer while a read is waited for", needs_pilot=True),
    _S("pilot_workers", int, 1, "loader threads for prefetched experts", "Prefetch workers", lo=1, hi=8,
       unit="threads", needs_pilot=True),
    _S("wide", int, 1, "prefetch up to top-k x wide candidate experts per layer", "Prefetch width", lo=1, hi=4,
       unit="× top-k", needs_pilot=True),
    _S("conf_limit", float, 0.92, "stop adding prefetch candidates at this cumulative router probability "
       "(only when wide > 1)", "Confidence limit", lo=0.1, hi=1.0, step=0.05, needs_pilot=True),
    _S("smooth", float, 0.3, "exponential moving average of router logits used by the predictor only "
       "(0 = none); routing itself always uses fresh logits", "Router smoothing", lo=0.0, hi=0.95, step=0.05,
       needs_pilot=True),
    _S("spec_precision", float, 0.7, "load a predicted expert only while predictions like it (same layer, "
       "rank and lookahead), measured online against the real routing, have been right at least this "
       "often (0 = load every prediction); higher reads fewer wasted bytes", "Prefetch precision",
       lo=0.0, hi=1.0, step=0.05, needs_pilot=True),
    _S("evict_guard", bool, True, "a prefetch never evicts an expert that is genuinely warm and clearly "
       "hotter", "Eviction guard", check_text="speculative loads may not evict warm experts", needs_pilot=True),
    _S("policy", str, "ema", "which cached expert to evict: lru = least recently used; lfru = least "
       "frequently and recently used (heat << 8 | recency); ema = the one the router has leaned towards "
       "least lately (moving average of its probabilities)", "Cache policy", choices=POLICIES),
    _S("cap", int, None, "expert slots per layer in RAM (auto: as many as the RAM budget holds)",
       "Cache slots per layer", lo=1, hi=65536, unit="experts/layer", auto=True),
    _S("ram_budget_gb", float, None, "total RAM the process may use (auto: the memory in use after the "
       "dense weights load plus 88% of the available memory)", "RAM budget", lo=0.1, hi=65536.0,
       unit="GB", auto=True, decimals=1, step=0.5),
    _S("context_length", int, 0, "tokens of conversation the model sees (KV cache; more uses more RAM; "
       "history and looked-up entries that do not fit are left out)",
       "Context length", lo=0, hi=1 << 20, unit="tokens", special="model default (≤ 4096)", step=256),
    _S("kv_dtype", str, "f16", "element of the KV cache: f16 (IEEE half, half the RAM per token of context; "
       "next-token probabilities indistinguishable from f32 on the bundled model) or f32",
       "KV cache precision", choices=KV_DTYPES, choice_labels=("f16 – half the RAM", "f32 – exact")),
    _S("o_direct", bool, True, "read experts with O_DIRECT, bypassing the OS page cache, so the RAM "
       "budget is real (where supported)", "Direct I/O", check_text="O_DIRECT reads (bypass the page cache)"),
    _S("reserve_cache", bool, False, "fault in the expert cache's whole RAM (every slot the cap allows) in a "
       "low-priority background thread from the moment the model opens, so no token pays the OS's page faults "
       "and zeroing later; the process's RSS rises to the cache's size within seconds instead of growing with "
       "use (with the automatic RAM budget on a model bigger than RAM that is most of the memory available "
       "at open). Off: only the next 2 slots of each layer are faulted in ahead", "Reserve cache memory", check_text="fault in the cache's memory when the model opens"),
    _S("idle_fill", bool, True, "from the moment the model opens, read the experts not yet in RAM into free "
       "cache slots in one sequential pass over the store (large reads in file order, at the disk's sequential "
       "rate) while no answer is being generated (an answer's own reads have the disk to themselves), never "
       "evicting one: a model whose experts fit in the cache becomes wholly resident seconds after it opens, so "
       "a question asked after that waits on no expert read (one asked sooner waits for the pass, layer by layer, "
       "instead of reading experts one by one beside it); one that does not fit gets its free slots filled "
       "with the experts its routing history uses most. Off: experts are read when the model first needs them", "Pre-read experts",
       check_text="read experts into free cache slots in the background"),
    _S("pinning", bool, True, "after warm-up keep the most used experts of each layer resident, and load "
       "them before the first token next time", "Hot pinning",
       check_text="pin the hottest experts and pre-warm them at start"),
    _S("pin_per_layer", int, 0, "how many experts per layer hot pinning may hold", "Pinned per layer",
       lo=0, hi=65536, unit="experts", special="auto (slots / 4)"),
    _S("checksum", str, "first", "verify expert slabs read from the SSD: never, on the first load of each "
       "expert, or on every load", "Expert checksums", choices=CHECKSUM_MODES),
    _S("io_threads", int, 1, "expert reads in flight at once (the SSD queue depth); 1 reads a layer's misses "
       "one after another in the order the layer computes them, so the first one needed arrives first "
       "(best on disks that are no faster at a deeper queue)",
       "Read threads", lo=1, hi=16, unit="threads"),
    _S("history", bool, True, "remember which experts are used (saved next to the model, per model) to "
       "pin and pre-warm the hottest", "Routing history", check_text="remember which experts are used (per model)"),
    _S("threads", int, 0, "threads for the numeric kernels (numba); auto: the cores this process may use "
       "(CPU affinity, cgroup quota) minus those other programs keep busy, re-counted while it generates", "Compute threads", lo=0, hi=1024,
       unit="threads", special="auto (free cores)", old_names=("numba_threads",)),
    _S("speculation", str, "prompt_lookup", "speculative decoding: draft the next tokens by finding the text's "
       "last few tokens earlier in the conversation (prompt lookup: strong when the answer repeats the "
       "question, as code edits and quotes do) and verify the draft in one forward, which reads each needed "
       "expert once for all its positions; the answer is the same token for token (every token is still the "
       "one the sampler picks); mtp = the model's own multi-token-prediction head drafts (DeepSeek-V3 / "
       "V3.2, GLM-4.5 / 5, Qwen3-Next stores converted with it; prompt lookup for a model without one); off = one token per "
       "forward", "Speculative decoding",
       choices=SPECULATION_MODES, choice_labels=("prompt lookup", "MTP head", "off")),
    _S("draft_max", int, 8, "most draft tokens one forward verifies; fewer are drafted when few are kept or "
       "a longer forward costs more than it saves (both measured while generating)", "Longest draft",
       lo=1, hi=32, unit="tokens"),
    _S("cluster", str, "", "expert-parallel serving: the address (host:port) of a Ray cluster started with "
       "`colibri cluster head`; the computers joined to it with `colibri cluster join` hold shares of the "
       "experts in their RAM and compute them, this computer keeps the hottest (empty = this computer only; "
       "needs `pip install 'colibri-desktop[cluster]'`)", "Cluster address"),
    _S("cluster_timeout_ms", int, 1000, "a cluster worker that has not answered a layer's call after this "
       "long is treated as down: its experts are read from this computer's SSD until it answers again",
       "Cluster timeout", lo=10, hi=600000, unit="ms", step=100),
)

SAMPLING_SETTINGS: tuple[Setting, ...] = (
    _S("temperature", float, 0.0, "randomness of sampling; 0 = greedy (always the most likely token)",
       "Temperature", group=SAMPLING, lo=0.0, hi=5.0, special="greedy", needs_reload=False, step=0.05),
    _S("top_k", int, 0, "sample only from the k most likely tokens", "Top-k", group=SAMPLING, lo=0, hi=100000,
       unit="tokens", special="off", needs_reload=False),
    _S("top_p", float, 1.0, "sample only from the smallest set of tokens whose probability adds up to p "
       "(1 = off)", "Top-p", group=SAMPLING, lo=0.0, hi=1.0, lo_open=True, needs_reload=False, decimals=3,
       step=0.05),
    _S("repetition_penalty", float, 1.0, "above 1 discourages tokens already in the conversation (CTRL; "
       "1 = off)", "Repetition penalty", group=SAMPLING, lo=0.5, hi=2.0, needs_reload=False, step=0.05),
    _S("seed", int, None, "same seed + same input = same output when sampling; auto = a new seed for "
       "every answer (the seed used is reported with the answer, so it can be reproduced)", "Seed",
       group=SAMPLING, lo=0, hi=2 ** 63 - 1, needs_reload=False, auto=True),
    _S("max_new_tokens", int, 512, "longest answer, in tokens", "Max new tokens", group=SAMPLING, lo=1,
       hi=1 << 20, unit="tokens", needs_reload=False, step=64),
    _S("docs_lookup", bool, True, "before each answer, look the question up in the model's documentation "
       "index (the bundled model: the docstrings of the Python standard library) and give the best three "
       "entries to the model with the question; they are listed with the answer (\"looked up\"). Only models "
       "that ship a documentation index have one", "Documentation lookup", group=SAMPLING, needs_reload=False,
       check_text="look questions up in the model's documentation"),
    _S("docs_copy", float, 0.5, "how strongly an answer that is quoting a looked-up entry keeps to that "
       "entry's words: the next-token probabilities are mixed with those of continuing the entry (kNN-LM "
       "interpolation); 0 = the model alone. The default scored best on test questions", "Copy from documentation", group=SAMPLING, lo=0.0, hi=1.0, needs_reload=False,
       step=0.1, decimals=2),
)


APP_SETTINGS: tuple[Setting, ...] = (
    _S("theme", str, "system", "colour scheme of the window: follow the desktop's light or dark setting, or "
       "always light or dark", "Colour scheme", group=APP, choices=THEMES, choice_labels=("System", "Light", "Dark"),
       needs_reload=False),
)


def check_context_length(context_length: int, max_positions: int, model: str = "this model") -> int:
    """The context length to use (``context_length``; 0 = the model's default) if the model
    can take it.

    Positions past ``max_positions`` (Hugging Face ``max_position_embeddings``) were never
    trained: rotary embeddings there give garbage, so a longer context is refused.

    Raises:
        ConfigError: the setting exceeds the model's limit; the message gives both numbers.
    """
    c = setting("context_length").check(context_length)
    if max_positions > 0 and c > max_positions:
        raise ConfigError(f"Context length {c} tokens is more than {model} was trained for "
                          f"({max_positions} tokens): past that it writes garbage. Choose at most "
                          f"{max_positions} tokens (0 = the model's default).")
    return c


def settings_table(group: str | None = None) -> tuple[Setting, ...]:
    """The table (one group, or all of it), in display order."""
    every = ENGINE_SETTINGS + SAMPLING_SETTINGS + APP_SETTINGS
    return every if group is None else tuple(s for s in every if s.group == group)


def setting(name: str) -> Setting:
    """The Setting called ``name`` (or one of its old names). Raises KeyError."""
    for s in settings_table():
        if s.name == name or name in s.old_names:
            return s
    raise KeyError(name)


def validate(obj, group: str) -> None:
    """Check every field of ``obj`` (an EngineConfig or SamplingParams) that the table declares.

    Raises:
        ConfigError: naming the first invalid setting, its value and the valid range.
    """
    for s in settings_table(group):
        s.check(getattr(obj, s.name))


def upgrade_keys(d: dict, group: str) -> dict:
    """``d`` with old keys renamed to the current ones (e.g. numba_threads -> threads)."""
    out = dict(d)
    for s in settings_table(group):
        for old in s.old_names:
            if old in out:
                v = out.pop(old)
                out.setdefault(s.name, v)
    return out


# --- the dataclasses derived from the table ---------------------------------------------------


def _annotation(s: Setting):
    return (s.type | None) if s.auto else s.type


def _engine_validated(self):
    """Return self after checking every field against the settings table.

    Raises:
        ConfigError: naming the setting, its value and the valid range.
    """
    validate(self, ENGINE)
    return self


def _to_dict(self) -> dict:
    return asdict(self)


def _engine_from_dict(cls, d: dict):
    """An EngineConfig from a dict (unknown keys ignored, old names accepted), validated."""
    d = upgrade_keys(d, ENGINE)
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names}).validated()


def _with(self, **kw):
    return replace(self, **kw)


def _engine_doc() -> str:
    lines = ["Runtime settings of an engine: they change speed and memory only, never the numbers.",
             "", "Derived from engine.settings.ENGINE_SETTINGS (one record per setting).", "", "Attributes:",
             "    store: path of a converted store (``colibri convert`` output)."]
    for s in settings_table(ENGINE):
        lines.append(f"    {s.name}: {s.help} ({s.range_text()}; default {s.default!r}).")
    return "\n".join(lines)


def _sampling_doc() -> str:
    lines = ["How the next token is chosen.", "",
             "temperature <= 0 means greedy (argmax, lowest id on ties). top_k = 0 and top_p = 1.0",
             "disable those filters. repetition_penalty follows the CTRL paper (Keskar et al. 2019):",
             "a logit l of a token already in the context becomes l / p if l > 0 else l * p.",
             "seed makes sampling reproducible: the same seed and inputs give the same tokens.",
             "Derived from engine.settings.SAMPLING_SETTINGS.", "", "Attributes:"]
    for s in settings_table(SAMPLING):
        lines.append(f"    {s.name}: {s.help} ({s.range_text()}; default {s.default!r}).")
    return "\n".join(lines)


def make_engine_config():
    """Build the EngineConfig dataclass from ENGINE_SETTINGS (store first, then the table)."""
    cls = make_dataclass(
        "EngineConfig", [("store", str, field(default=""))]
        + [(s.name, _annotation(s), field(default=s.default)) for s in settings_table(ENGINE)],
        frozen=True, namespace={"validated": _engine_validated, "to_dict": _to_dict,
                                "from_dict": classmethod(_engine_from_dict), "with_": _with})
    cls.__module__ = "engine.config"
    cls.__doc__ = _engine_doc()
    return cls


def make_sampling_params():
    """Build the SamplingParams dataclass from SAMPLING_SETTINGS."""
    cls = make_dataclass("SamplingParams", [(s.name, _annotation(s), field(default=s.default))
                                            for s in settings_table(SAMPLING)], frozen=True)
    cls.__module__ = "engine.events"
    cls.__doc__ = _sampling_doc()
    return cls


def make_app_settings():
    """Build the AppSettings dataclass (the desktop app's own settings) from APP_SETTINGS."""
    cls = make_dataclass("AppSettings", [(s.name, _annotation(s), field(default=s.default))
                                         for s in settings_table(APP)], frozen=True)
    cls.__module__ = "engine.settings"
    cls.__doc__ = "The desktop app's own settings (look only). Attributes:\n" + "\n".join(
        f"    {s.name}: {s.help} ({s.range_text()}; default {s.default!r})." for s in settings_table(APP))
    return cls


EngineConfig = make_engine_config()
SamplingParams = make_sampling_params()
AppSettings = make_app_settings()
