"""Settings dialog: engine settings (speed and memory) and generation defaults.

Every widget is derived from the settings table (engine.settings): its kind (check box, list,
spin box, "auto" pair), range, unit (suffix), tooltip (help and valid range), label and
whether a change reopens the model (marked ⟳). Number fields read ``0,6`` and ``0.6`` alike in
every locale and show numbers in the user's (colibri_app.numbers); what they cannot read, or
what is outside their range, is refused with a sentence saying why, and the whole form is validated with the table's one validation, with an
inline error that disables OK / Apply. "auto" shows the value the engine picks for the current
model (``auto_values``). OK / Apply save the settings atomically (``save``, default
settings_store.save_settings; None when the receiver of ``applied`` saves them, as MainWindow
does: one save per Apply) and emit ``applied(new_settings, needs_reload)``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from PySide6.QtCore import QRegularExpression, Signal, Slot
from PySide6.QtGui import QRegularExpressionValidator
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDialog, QDialogButtonBox, QDoubleSpinBox, QFormLayout,
                               QGroupBox, QHBoxLayout, QLabel, QLineEdit, QPushButton, QSpinBox, QVBoxLayout,
                               QWidget)

from engine import APP, ENGINE, SAMPLING, ConfigError, EngineConfig, Setting, settings_table, validate
from .numbers import DecimalBox, WholeBox
from .settings_store import Settings, save_settings

RELOAD_MARK = "⟳"
GROUP_TITLES = {ENGINE: "Engine", SAMPLING: "Generation", APP: "Appearance"}
QT_INT_MAX = 2 ** 31 - 1  # QSpinBox holds a C int; larger ranges (the seed) get a line edit
AutoValues = Callable[[EngineConfig], "tuple[int, int] | None"]


def _label(s: Setting) -> str:
    return f"{s.label} {RELOAD_MARK}" if s.needs_reload else s.label


def _tooltip(s: Setting) -> str:
    return f"{s.help[0].upper()}{s.help[1:]}.\nValid range: {s.range_text()}"


class SettingsDialog(QDialog):
    """Edit ``settings``; see the module docstring.

    Signals:
        applied(Settings, bool): the new settings (already saved, unless ``save`` is None) and
            whether the engine must be reopened for them (Settings.needs_reload).
        reset_history_requested(): the user asked to forget the routing history (heat) of the
            current model.
    Args:
        auto_values: (cap, budget bytes) the engine picks for "auto" with a candidate
            EngineConfig (None: unknown); shown beside the "auto" boxes.
        compile_note: the sentence saying a candidate EngineConfig needs a one-time compile of
            the compute kernels ("" when it does not); shown with the pending changes, before
            they are applied.
        save: called once per Apply / OK with the new settings (default: save_settings);
            None when the receiver of ``applied`` saves them.
    Attributes:
        fields: {setting name: editor widget}, for tests and for focusing a field.
        auto_boxes: {setting name: its "auto" check box} (cap, ram_budget_gb).
    """

    applied = Signal(object, bool)
    reset_history_requested = Signal()

    def __init__(self, settings: Settings, parent: QWidget | None = None,
                 auto_values: AutoValues | None = None,
                 save: Callable[[Settings], object] | None = ...,
                 compile_note: Callable[[EngineConfig], str] | None = None):
        super().__init__(parent)
        self._save = save_settings if save is ... else save
        self.setWindowTitle("Settings")
        self._base = settings
        self._auto_values = auto_values
        self._compile_note = compile_note
        self._compile_notes: dict[tuple, str] = {}
        self.fields: dict[str, QWidget] = {}
        self.auto_boxes: dict[str, QCheckBox] = {}
        self._valid: Settings | None = settings
        self.save_error: str | None = None

        note = QLabel(f"Changes marked {RELOAD_MARK} reopen the model. Engine settings change speed and "
                      f"memory use only, never the generated text.")
        note.setWordWrap(True)
        note.setObjectName("reloadNote")

        groups = QHBoxLayout()
        groups.addWidget(self._group(ENGINE), 1)
        right = QVBoxLayout()
        right.addWidget(self._group(SAMPLING))
        right.addWidget(self._group(APP))   # the app's look: applied at once, never reopens the model
        right.addStretch(1)
        groups.addLayout(right, 1)
        self.cap_auto = self.auto_boxes["cap"]
        self.budget_auto = self.auto_boxes["ram_budget_gb"]

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
        for w in list(self.fields.values()) + list(self.auto_boxes.values()):
            self._connect(w)
        self._revalidate()

    # --- building (one widget per row of the settings table) ------------------------------------

    def _widget(self, s: Setting) -> QWidget:
        tip = _tooltip(s)
        if s.type is bool:
            w = QCheckBox(s.check_text or s.label)
        elif s.choices:
            w = QComboBox()
            w.addItems([str(x) for x in (s.choice_labels or s.choices)])
        elif s.type is str:  # free text (the cluster address)
            w = QLineEdit()
            w.setPlaceholderText("this computer only")
        elif s.type is int and (s.hi or 0) > QT_INT_MAX:
            w = QLineEdit()
            digits = len(str(int(s.hi)))
            # separators get through, to be refused with a reason (not "1.000" read as 1000)
            w.setValidator(QRegularExpressionValidator(QRegularExpression(rf"[\d.,\s]{{0,{digits + 8}}}"), w))
            w.setPlaceholderText("" if s.default is None else str(s.default))
        else:
            w = WholeBox() if s.type is int else DecimalBox()   # 0,6 and 0.6 alike, in any locale
            if s.type is float:
                w.setDecimals(s.decimals)
            lo = s.lo + 10 ** -s.decimals if s.lo_open else s.lo
            w.setRange(lo, s.hi)
            w.setSingleStep(s.step)
            if s.unit:
                sfx = f" {s.unit}"
                w.setSuffix(sfx)
                if sfx.endswith("s"):  # "1 thread", "2 threads"
                    w.valueChanged.connect(lambda v, w=w, sfx=sfx: w.setSuffix(sfx[:-1] if v == 1 else sfx))
                    w.setSuffix(sfx[:-1] if w.value() == 1 else sfx)
            if s.special:
                w.setSpecialValueText(s.special)
        w.setToolTip(tip)
        w.setObjectName(s.name)
        w.setAccessibleName(s.label)
        self.fields[s.name] = w
        if not s.auto:
            return w
        box = QCheckBox("auto")
        box.setObjectName(f"{s.name}_auto")
        box.setAccessibleName(f"{s.label}: automatic")
        box.setToolTip(s.help[0].upper() + s.help[1:] + ".")
        box.toggled.connect(lambda on, w=w: w.setEnabled(not on))
        self.auto_boxes[s.name] = box
        return self._pair(box, w)

    def _group(self, group: str) -> QGroupBox:
        g = QGroupBox(GROUP_TITLES.get(group, group.title()))
        f = QFormLayout(g)
        for s in settings_table(group):
            f.addRow(_label(s), self._widget(s))
            if s.name == "history":
                self.reset_history_button = QPushButton("Reset routing history")
                self.reset_history_button.setToolTip("Forget the routing history of the current model.")
                self.reset_history_button.clicked.connect(self._reset_history)
                f.addRow("", self.reset_history_button)
        if group == ENGINE and "pilot" in self.fields:
            pilot_only = [self.fields[s.name] for s in settings_table(group) if s.needs_pilot]

            def pilot_changed(mode: int) -> None:  # prefetch knobs mean nothing with PILOT off
                for w in pilot_only:
                    w.setEnabled(mode > 0)
            self.fields["pilot"].currentIndexChanged.connect(pilot_changed)
            pilot_changed(self.fields["pilot"].currentIndex())
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
            if hasattr(w, "problem_changed"):
                w.problem_changed.connect(self._revalidate)
        elif isinstance(w, QCheckBox):
            w.toggled.connect(self._revalidate)
        elif isinstance(w, QComboBox):
            w.currentIndexChanged.connect(self._revalidate)
        elif isinstance(w, QLineEdit):
            w.textChanged.connect(self._revalidate)

    # --- values -------------------------------------------------------------------------------

    def _set(self, s: Setting, value) -> None:
        w = self.fields[s.name]
        if s.auto:
            self.auto_boxes[s.name].setChecked(value is None)
            w.setEnabled(value is not None)
            if value is None:
                return
        if isinstance(w, QCheckBox):
            w.setChecked(bool(value))
        elif isinstance(w, QComboBox):
            w.setCurrentIndex(s.choices.index(value) if value in s.choices else 0)
        elif isinstance(w, QLineEdit):
            w.setText(str(value))
        else:
            w.setValue(value)
            if hasattr(w, "problem"):
                w._set_problem("")

    def _get(self, s: Setting, base):
        """The value the widget of ``s`` holds (``base``: the stored value, kept when the widget
        shows it rounded, so that opening and closing the dialog changes nothing).

        Raises:
            ConfigError: an empty or out-of-range number in a text field, or a spin box's text
                that cannot be read as a number (numbers.DecimalBox / WholeBox).
        """
        w = self.fields[s.name]
        if s.auto and self.auto_boxes[s.name].isChecked():
            return None
        if isinstance(w, QCheckBox):
            return w.isChecked()
        if isinstance(w, QComboBox):
            return s.choices[w.currentIndex()]
        if isinstance(w, QLineEdit) and s.type is str:
            return s.check(w.text().strip())
        if isinstance(w, QLineEdit):
            text = w.text().strip()
            if not text:
                raise ConfigError(f"setting '{s.name}' is empty: enter a whole number "
                                  f"{s.range_text()}")
            if not text.isdigit():
                raise ConfigError(f"{s.label}: “{text}” is not a whole number: type digits only, "
                                  f"without separators")
            return s.check(int(text))
        if getattr(w, "problem", ""):  # typed text that cannot be read as a number
            raise ConfigError(f"{s.label}: {w.problem}")
        v = w.value()
        if isinstance(w, QDoubleSpinBox):
            if base is not None and abs(v - round(base, w.decimals())) < 1e-9:
                return base
            return round(v, w.decimals())
        return v

    def _load(self, st: Settings) -> None:
        for s in settings_table(ENGINE):
            self._set(s, getattr(st.engine, s.name))
        for s in settings_table(SAMPLING):
            self._set(s, getattr(st.sampling, s.name))
        for s in settings_table(APP):
            self._set(s, getattr(st.app, s.name))

    def current_settings(self) -> Settings:
        """The settings the form describes (current_model kept from the dialog's settings).

        Raises:
            ConfigError / ValueError: naming the invalid setting and its range.
        """
        be, bs = self._base.engine, self._base.sampling
        engine = replace(be, **{s.name: self._get(s, getattr(be, s.name)) for s in settings_table(ENGINE)}).validated()
        sampling = replace(bs, **{s.name: self._get(s, getattr(bs, s.name)) for s in settings_table(SAMPLING)})
        validate(sampling, SAMPLING)
        ba = self._base.app
        app = replace(ba, **{s.name: self._get(s, getattr(ba, s.name)) for s in settings_table(APP)})
        validate(app, APP)
        return replace(self._base, engine=engine, sampling=sampling, app=app)

    def show_in_use(self, in_use: dict[str, str], max_context: int = 0, model: str = "") -> None:
        """Show what the open engine uses where a setting's special value lets it decide
        (``in_use``: {setting name: text}, e.g. {"threads": "2 now"}): the spin box's special
        text reads "<special>: <text>". ``max_context``: the open model's context limit
        (max_position_embeddings); the context length box stops there and says why."""
        for name, text in in_use.items():
            w = self.fields.get(name)
            st = next((x for x in settings_table() if x.name == name), None)
            if w is None or st is None or not st.special or not hasattr(w, "setSpecialValueText"):
                continue
            w.setSpecialValueText(f"{st.special}: {text}")
        w = self.fields.get("context_length")
        if max_context > 0 and w is not None and hasattr(w, "setMaximum"):
            w.setMaximum(max_context)
            why = (f"{model or 'The open model'} was trained for at most {max_context} tokens; a longer "
                   f"context writes garbage, so it is refused.")
            w.setToolTip(f"{w.toolTip()}\n{why}")
            self.context_limit_text = why

    def _show_auto(self, engine: EngineConfig) -> None:
        """Write the values the engine would pick into the "auto" check boxes."""
        picked = None
        if self._auto_values is not None:
            try:
                picked = self._auto_values(engine)
            except Exception:  # noqa: BLE001 - a store that cannot be sized shows plain "auto"
                picked = None
        if picked is None:
            self.cap_auto.setText("auto")
            self.budget_auto.setText("auto")
            return
        cap, budget = picked
        gb = self.fields["ram_budget_gb"].locale().toString(budget / 1e9, "f", 1)  # "2,5" in German
        self.cap_auto.setText(f"auto ({cap} experts / {gb} GB)")
        self.budget_auto.setText(f"auto ({gb} GB)")
        # an unticked "auto" starts from the engine's pick
        for box, w, v in ((self.cap_auto, self.fields["cap"], cap),
                          (self.budget_auto, self.fields["ram_budget_gb"], budget / 1e9)):
            if box.isChecked():
                w.blockSignals(True)
                w.setValue(v)
                w.blockSignals(False)

    @Slot()
    def _revalidate(self, *_args) -> None:
        try:
            new = self.current_settings()
        except (ConfigError, ValueError) as e:
            self._valid = None
            from .engine_bridge import app_words
            self.error_label.setText(f"Not applied: {app_words(str(e))}")
            self.error_label.show()
            self.status_label.setText("")
        else:
            self._valid = new
            self.error_label.hide()
            self._show_auto(new.engine)
            if self._base.needs_reload(new):
                self.status_label.setText(f"Pending changes marked {RELOAD_MARK} will reopen the model."
                                          + self._compile_text(new.engine))
            elif new.engine != self._base.engine or new.sampling != self._base.sampling:
                self.status_label.setText("Pending changes apply to the next message.")
            elif new != self._base:
                self.status_label.setText("Pending changes apply at once.")
            else:
                self.status_label.setText("")
        ok = self._valid is not None
        self.buttons.button(QDialogButtonBox.Ok).setEnabled(ok)
        self.buttons.button(QDialogButtonBox.Apply).setEnabled(ok)

    def _compile_text(self, engine: EngineConfig) -> str:
        """" " + the compile_note for ``engine`` when it needs other kernels than the open
        settings (PILOT on / off, the KV cache type), else ""."""
        key = (engine.pilot > 0, engine.kv_dtype)
        if self._compile_note is None or key == (self._base.engine.pilot > 0, self._base.engine.kv_dtype):
            return ""
        if key not in self._compile_notes:  # asked once per kind: it opens the store's manifest
            try:
                self._compile_notes[key] = self._compile_note(engine)
            except Exception:  # noqa: BLE001 - no note rather than no dialog
                self._compile_notes[key] = ""
        note = self._compile_notes[key]
        return f" {note}" if note else ""

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
        if self._save is not None:
            try:
                self._save(new)
            except OSError as e:
                self.save_error = str(e)
        self._base = new
        self.applied.emit(new, reload_needed)
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
        self.reset_history_requested.emit()
        self.status_label.setText("The routing history of the current model will be reset.")
