"""Settings dialog: engine settings (speed and memory) and generation defaults.

Every field shows its unit (suffix) and valid range (tooltip); spin boxes refuse values
outside their range as they are typed, and the whole form is validated with
EngineConfig.validated / validate_sampling, with an inline error that disables OK / Apply.
Fields marked ⟳ need the model to be reopened. OK / Apply save the settings atomically
(settings_store.save_settings) and emit ``applied(new_settings, needs_reload)``.
"""

from __future__ import annotations

import os
from dataclasses import replace

from PySide6.QtCore import QRegularExpression, Signal, Slot
from PySide6.QtGui import QRegularExpressionValidator
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDialog, QDialogButtonBox, QDoubleSpinBox, QFormLayout,
                               QGroupBox, QHBoxLayout, QLabel, QLineEdit, QPushButton, QSpinBox, QVBoxLayout,
                               QWidget)

from engine import POLICIES, ConfigError, SamplingParams
from .settings_store import RELOAD_FIELDS, Settings, save_settings, validate_sampling
from .wizard import qt_emit

RELOAD_MARK = "⟳"
SEED_MAX = 2 ** 63 - 1
PILOT_MODES = ("0 – off (load experts on demand only)",
               "1 – predict the next layer",
               "2 – predict the next 2 layers",
               "3 – predict the next 3 layers")


def _label(text: str, field: str) -> str:
    return f"{text} {RELOAD_MARK}" if field in RELOAD_FIELDS else text


class SettingsDialog(QDialog):
    """Edit ``settings``; see the module docstring.

    Signals:
        applied(Settings, bool): the new settings (already saved) and whether the engine must
            be reopened for them (Settings.needs_reload).
        reset_history_requested(): the user asked to forget the routing history (heat) of the
            current model.
    Attributes:
        fields: {setting name: editor widget}, for tests and for focusing a field.
    """

    applied = Signal(object, bool)
    reset_history_requested = Signal()

    def __init__(self, settings: Settings, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Settings")
        self._base = settings
        self.fields: dict[str, QWidget] = {}
        self._valid: Settings | None = settings
        self.save_error: str | None = None

        note = QLabel(f"Changes marked {RELOAD_MARK} reopen the model. Engine settings change speed and "
                      f"memory use only, never the generated text.")
        note.setWordWrap(True)
        note.setObjectName("reloadNote")

        groups = QHBoxLayout()
        groups.addWidget(self._engine_group(), 1)
        groups.addWidget(self._generation_group(), 1)

        self.error_label = QLabel()
        self.error_label.setObjectName("errorLabel")
        self.error_label.setStyleSheet("color: #c62828; font-weight: bold;")
        self.error_label.setWordWrap(True)
        self.error_label.hide()
        self.status_label = QLabel()
        self.status_label.setObjectName("statusLabel")
        self.status_label.setWordWrap(True)

        self.buttons = QDialogButtonBox(QDialogButtonBox.Ok | QDialogButtonBox.Apply | QDialogButtonBox.Cancel
                                        | QDialogButtonBox.RestoreDefaults)
        self.buttons.accepted.connect(self._ok)
        self.buttons.rejected.connect(self.reject)
        self.buttons.button(QDialogButtonBox.Apply).clicked.connect(self.apply)
        self.buttons.button(QDialogButtonBox.RestoreDefaults).clicked.connect(self.restore_defaults)
        self.buttons.button(QDialogButtonBox.RestoreDefaults).setToolTip(
            "Put every field back to its default value (nothing changes until OK or Apply).")

        lay = QVBoxLayout(self)
        lay.addWidget(note)
        lay.addLayout(groups)
        lay.addWidget(self.error_label)
        lay.addWidget(self.status_label)
        lay.addWidget(self.buttons)

        self._load(settings)
        for w in self.fields.values():
            self._connect(w)
        self.cap_auto.toggled.connect(self._revalidate)
        self.budget_auto.toggled.connect(self._revalidate)
        self._revalidate()

    # --- building -----------------------------------------------------------------------------

    def _spin(self, name, lo, hi, suffix="", tip="", step=1, special=None) -> QSpinBox:
        w = QSpinBox()
        w.setRange(lo, hi)
        w.setSingleStep(step)
        if suffix:
            w.setSuffix(suffix)
            if suffix.endswith("s"):  # "1 thread", "2 threads"
                w.valueChanged.connect(lambda v, w=w, sfx=suffix: w.setSuffix(sfx[:-1] if v == 1 else sfx))
                w.setSuffix(suffix[:-1] if w.value() == 1 else suffix)
        if special:
            w.setSpecialValueText(special)
        w.setToolTip(f"{tip}\nValid range: {lo}–{hi}{suffix}" + (f" ({lo} = {special})" if special else ""))
        w.setObjectName(name)
        self.fields[name] = w
        return w

    def _dspin(self, name, lo, hi, decimals=2, step=0.05, suffix="", tip="", special=None) -> QDoubleSpinBox:
        w = QDoubleSpinBox()
        w.setDecimals(decimals)
        w.setRange(lo, hi)
        w.setSingleStep(step)
        if suffix:
            w.setSuffix(suffix)
            if suffix.endswith("s"):  # "1 thread", "2 threads"
                w.valueChanged.connect(lambda v, w=w, sfx=suffix: w.setSuffix(sfx[:-1] if v == 1 else sfx))
                w.setSuffix(suffix[:-1] if w.value() == 1 else suffix)
        if special:
            w.setSpecialValueText(special)
        w.setToolTip(f"{tip}\nValid range: {lo:g}–{hi:g}{suffix}" + (f" ({lo:g} = {special})" if special else ""))
        w.setObjectName(name)
        self.fields[name] = w
        return w

    def _check(self, name, text, tip) -> QCheckBox:
        w = QCheckBox(text)
        w.setToolTip(tip)
        w.setObjectName(name)
        self.fields[name] = w
        return w

    def _combo(self, name, items, tip) -> QComboBox:
        w = QComboBox()
        w.addItems(list(items))
        w.setToolTip(tip)
        w.setObjectName(name)
        self.fields[name] = w
        return w

    def _engine_group(self) -> QGroupBox:
        g = QGroupBox("Engine")
        f = QFormLayout(g)
        f.addRow(_label("PILOT prefetch", "pilot"), self._combo(
            "pilot", PILOT_MODES, "Router lookahead: load the experts the next layers will probably need "
            "while the current layer computes. Valid: 0–3."))
        f.addRow(_label("Prefetch workers", "pilot_workers"), self._spin(
            "pilot_workers", 1, 8, " threads", "Loader threads for prefetched experts."))
        f.addRow(_label("Prefetch width", "wide"), self._spin(
            "wide", 1, 4, " × top-k", "Prefetch up to top-k × width candidate experts per layer."))
        f.addRow(_label("Confidence limit", "conf_limit"), self._dspin(
            "conf_limit", 0.10, 1.00, tip="Stop adding prefetch candidates at this cumulative router "
            "probability (only when the width is above 1)."))
        f.addRow(_label("Router smoothing", "smooth"), self._dspin(
            "smooth", 0.0, 0.95, tip="Exponential moving average of router logits used by the predictor "
            "only (0 = none). Routing itself always uses fresh logits."))
        f.addRow(_label("Prefetch precision", "spec_precision"), self._dspin(
            "spec_precision", 0.0, 1.0, tip="Load a predicted expert only while predictions like it "
            "(same layer, rank and lookahead) have been right at least this often (0 = load every "
            "prediction). Higher reads fewer wasted bytes from the SSD."))
        f.addRow(_label("Eviction guard", "evict_guard"), self._check(
            "evict_guard", "speculative loads may not evict warm experts",
            "When on, a prefetch never evicts an expert that is genuinely warm and clearly hotter."))
        f.addRow(_label("Cache policy", "policy"), self._combo(
            "policy", POLICIES, "Which cached expert to evict: lru = least recently used; lfru = "
            "least frequently and recently used (heat, then recency); ema = the one the router has "
            "leaned towards least lately (moving average of its probabilities)."))

        pilot_only = [self.fields[n] for n in ("pilot_workers", "wide", "conf_limit", "smooth",
                                                 "spec_precision", "evict_guard")]

        def pilot_changed(mode: int) -> None:  # prefetch knobs mean nothing with PILOT off
            for w in pilot_only:
                w.setEnabled(mode > 0)
        self.fields["pilot"].currentIndexChanged.connect(pilot_changed)
        pilot_changed(self.fields["pilot"].currentIndex())

        self.cap_auto = QCheckBox("auto")
        self.cap_auto.setObjectName("cap_auto")
        self.cap_auto.setToolTip("Size the expert cache from the RAM budget.")
        cap = self._spin("cap", 1, 65536, " experts/layer", "Expert slots per layer in RAM.")
        self.cap_auto.toggled.connect(lambda on: cap.setEnabled(not on))
        f.addRow(_label("Cache slots per layer", "cap"), self._pair(self.cap_auto, cap))

        self.budget_auto = QCheckBox("auto")
        self.budget_auto.setObjectName("ram_budget_auto")
        self.budget_auto.setToolTip("Use the memory currently used plus 88% of the available memory.")
        budget = self._dspin("ram_budget_gb", 0.1, 65536.0, decimals=1, step=0.5, suffix=" GB",
                             tip="Total RAM the app may use (1 GB = 10^9 bytes).")
        self.budget_auto.toggled.connect(lambda on: budget.setEnabled(not on))
        f.addRow(_label("RAM budget", "ram_budget_gb"), self._pair(self.budget_auto, budget))

        f.addRow(_label("Direct I/O", "o_direct"), self._check(
            "o_direct", "O_DIRECT reads (bypass the page cache)",
            "Read experts without the OS page cache so the RAM budget is real (where supported)."))
        f.addRow(_label("Hot pinning", "pinning"), self._check(
            "pinning", "pin the hottest experts and pre-warm them at start",
            "After warm-up, keep the most used experts of each layer resident; load them before the first "
            "token next time."))
        f.addRow(_label("Pinned per layer", "pin_per_layer"), self._spin(
            "pin_per_layer", 0, 65536, " experts", "How many experts per layer pinning may hold.",
            special="auto (slots / 4)"))
        f.addRow(_label("Expert checksums", "checksum"), self._combo(
            "checksum", ("off", "first", "always"), "Verify expert slabs read from the SSD: never, on the "
            "first load of each expert, or on every load."))
        f.addRow(_label("Routing history", "history"), self._check(
            "history", "remember which experts are used (per model)",
            "Saved next to the model; used to pin and pre-warm the hottest experts."))
        self.reset_history_button = QPushButton("Reset routing history")
        self.reset_history_button.setToolTip("Forget the routing history of the current model.")
        self.reset_history_button.clicked.connect(self._reset_history)
        f.addRow("", self.reset_history_button)
        f.addRow(_label("Compute threads", "numba_threads"), self._spin(
            "numba_threads", 0, max(256, os.cpu_count() or 1), " threads",
            f"Threads for the numeric kernels ({os.cpu_count() or 1} cores here).", special="all cores"))
        return g

    def _generation_group(self) -> QGroupBox:
        g = QGroupBox("Generation")
        f = QFormLayout(g)
        f.addRow("Temperature", self._dspin(
            "temperature", 0.0, 5.0, tip="Randomness of sampling; 0 = greedy (always the most likely token).",
            special="0 (greedy)"))
        f.addRow("Top-p", self._dspin(
            "top_p", 0.001, 1.0, decimals=3, step=0.05, tip="Sample only from the smallest set of tokens whose "
            "probability adds up to p (1 = off)."))
        f.addRow("Top-k", self._spin(
            "top_k", 0, 100000, " tokens", "Sample only from the k most likely tokens.", special="off"))
        f.addRow("Repetition penalty", self._dspin(
            "repetition_penalty", 0.5, 2.0, tip="Above 1 discourages tokens already in the conversation "
            "(1 = off)."))
        seed = QLineEdit()
        seed.setObjectName("seed")
        seed.setValidator(QRegularExpressionValidator(QRegularExpression(r"\d{0,19}"), seed))
        seed.setToolTip(f"Same seed + same input = same output when sampling.\nValid range: 0–{SEED_MAX}")
        seed.setPlaceholderText("0")
        self.fields["seed"] = seed
        f.addRow("Seed", seed)
        f.addRow("Max new tokens", self._spin(
            "max_new_tokens", 1, 1 << 20, " tokens", "Longest answer, in tokens.", step=64))
        f.addRow(_label("Context length", "context_length"), self._spin(
            "context_length", 0, 1 << 20, " tokens", "Tokens of conversation the model sees (KV cache; "
            "more uses more RAM).", step=256, special="model default (≤ 4096)"))
        return g

    @staticmethod
    def _pair(check: QCheckBox, w: QWidget) -> QWidget:
        box = QWidget()
        h = QHBoxLayout(box)
        h.setContentsMargins(0, 0, 0, 0)
        h.addWidget(check)
        h.addWidget(w, 1)
        return box

    def _connect(self, w: QWidget) -> None:
        if isinstance(w, (QSpinBox, QDoubleSpinBox)):
            w.valueChanged.connect(self._revalidate)
        elif isinstance(w, QCheckBox):
            w.toggled.connect(self._revalidate)
        elif isinstance(w, QComboBox):
            w.currentIndexChanged.connect(self._revalidate)
        elif isinstance(w, QLineEdit):
            w.textChanged.connect(self._revalidate)

    # --- values -------------------------------------------------------------------------------

    def _load(self, s: Settings) -> None:
        e, p, F = s.engine, s.sampling, self.fields
        F["pilot"].setCurrentIndex(e.pilot if 0 <= e.pilot <= 3 else 1)
        for name in ("pilot_workers", "wide", "pin_per_layer", "numba_threads", "context_length"):
            F[name].setValue(getattr(e, name))
        F["conf_limit"].setValue(e.conf_limit)
        F["smooth"].setValue(e.smooth)
        F["spec_precision"].setValue(e.spec_precision)
        for name in ("evict_guard", "o_direct", "pinning", "history"):
            F[name].setChecked(bool(getattr(e, name)))
        F["policy"].setCurrentText(e.policy)
        F["checksum"].setCurrentText(e.checksum)
        self.cap_auto.setChecked(e.cap is None)
        F["cap"].setEnabled(e.cap is not None)
        F["cap"].setValue(e.cap if e.cap is not None else 16)
        self.budget_auto.setChecked(e.ram_budget_gb is None)
        F["ram_budget_gb"].setEnabled(e.ram_budget_gb is not None)
        F["ram_budget_gb"].setValue(e.ram_budget_gb if e.ram_budget_gb is not None else 8.0)
        F["temperature"].setValue(p.temperature)
        F["top_p"].setValue(p.top_p)
        F["top_k"].setValue(p.top_k)
        F["repetition_penalty"].setValue(p.repetition_penalty)
        F["seed"].setText(str(p.seed))
        F["max_new_tokens"].setValue(p.max_new_tokens)

    def current_settings(self) -> Settings:
        """The settings the form describes (current_model kept from the dialog's settings).

        Raises:
            ConfigError / ValueError: naming the invalid setting and its range.
        """
        F, be, bs = self.fields, self._base.engine, self._base.sampling

        def fv(name: str, base: float | None) -> float:
            # keep the stored value when the spin box shows it rounded (no phantom changes)
            w = F[name]
            v = w.value()
            if base is not None and abs(v - round(base, w.decimals())) < 1e-9:
                return base
            return round(v, w.decimals())
        engine = replace(
            self._base.engine,
            pilot=F["pilot"].currentIndex(), pilot_workers=F["pilot_workers"].value(), wide=F["wide"].value(),
            conf_limit=fv("conf_limit", be.conf_limit), smooth=fv("smooth", be.smooth),
            spec_precision=fv("spec_precision", be.spec_precision),
            evict_guard=F["evict_guard"].isChecked(), policy=F["policy"].currentText(),
            cap=None if self.cap_auto.isChecked() else F["cap"].value(),
            ram_budget_gb=None if self.budget_auto.isChecked() else fv("ram_budget_gb", be.ram_budget_gb),
            o_direct=F["o_direct"].isChecked(), pinning=F["pinning"].isChecked(),
            pin_per_layer=F["pin_per_layer"].value(), checksum=F["checksum"].currentText(),
            history=F["history"].isChecked(), numba_threads=F["numba_threads"].value(),
            context_length=F["context_length"].value()).validated()
        seed_text = F["seed"].text().strip()
        if not seed_text:
            raise ConfigError(f"setting 'seed' is empty: enter a whole number 0–{SEED_MAX}")
        if int(seed_text) > SEED_MAX:
            raise ConfigError(f"setting 'seed' = {seed_text} is out of range 0–{SEED_MAX}")
        sampling = SamplingParams(
            temperature=fv("temperature", bs.temperature), top_k=F["top_k"].value(),
            top_p=fv("top_p", bs.top_p), repetition_penalty=fv("repetition_penalty", bs.repetition_penalty),
            seed=int(seed_text), max_new_tokens=F["max_new_tokens"].value())
        validate_sampling(sampling)
        return replace(self._base, engine=engine, sampling=sampling)

    @Slot()
    def _revalidate(self, *_args) -> None:
        try:
            new = self.current_settings()
        except (ConfigError, ValueError) as e:
            self._valid = None
            self.error_label.setText(f"Not applied: {e}")
            self.error_label.show()
            self.status_label.setText("")
        else:
            self._valid = new
            self.error_label.hide()
            if self._base.needs_reload(new):
                self.status_label.setText(f"Pending changes marked {RELOAD_MARK} will reopen the model.")
            elif new != self._base:
                self.status_label.setText("Pending changes apply to the next message.")
            else:
                self.status_label.setText("")
        ok = self._valid is not None
        self.buttons.button(QDialogButtonBox.Ok).setEnabled(ok)
        self.buttons.button(QDialogButtonBox.Apply).setEnabled(ok)

    @property
    def is_valid(self) -> bool:
        """False while a field holds an invalid value (OK and Apply are disabled)."""
        return self._valid is not None

    # --- actions ------------------------------------------------------------------------------

    @Slot()
    def apply(self) -> bool:
        """Validate, save atomically and emit ``applied``. Returns False if the form is invalid."""
        self._revalidate()
        new = self._valid
        if new is None:
            return False
        reload_needed = self._base.needs_reload(new)
        self.save_error = None
        try:
            save_settings(new)
        except OSError as e:
            self.save_error = str(e)
        self._base = new
        qt_emit(self.applied, new, reload_needed)
        msg = "Applied." + (f" The model will be reopened for the changes marked {RELOAD_MARK}."
                            if reload_needed else "")
        if self.save_error:
            msg += f" The settings could not be saved ({self.save_error}); they last until you quit."
        self.status_label.setText(msg)
        return True

    @Slot()
    def _ok(self) -> None:
        if self.apply():
            self.accept()

    @Slot()
    def restore_defaults(self) -> None:
        """Fill the form with the default settings (applied only with OK / Apply)."""
        self._load(Settings(current_model=self._base.current_model))
        self._revalidate()

    @Slot()
    def _reset_history(self) -> None:
        qt_emit(self.reset_history_requested)
        self.status_label.setText("The routing history of the current model will be reset.")
