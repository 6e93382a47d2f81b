"""The app's persisted settings: engine settings, sampling defaults, current model.

One versioned JSON file in the user config directory (platformdirs), written atomically.

Forward-compatible: keys this build does not know (a newer build's settings, in any section)
are kept and written back untouched; a file of a newer ``version`` is read for the keys this
build knows, with one note, and its version and the values this build refused are written back
as they were. A value out of range falls back to its default with a note naming it. Only a
file that is not a settings file at all (not JSON, not an object, another format) is moved
aside as ``settings.json.bad-<time>`` (the note says where and how to get it back); a file that
cannot be read (permissions, a folder of that name) is left where it is.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from engine import (APP, ENGINE, SAMPLING, AppSettings, ConfigError, EngineConfig, SamplingParams, library,
                    settings_table, upgrade_keys, validate)

SETTINGS_FORMAT = "colibri-desktop-settings"
# 2: the sampling seed may be null ("auto": a new seed for every answer, the default).  A
# version-1 file is read with its seed 0 (version 1's default; "auto" did not exist) as auto.
SETTINGS_VERSION = 2
FILENAME = "settings.json"

# Settings whose change reopens the engine (from the settings table, engine.settings).
RELOAD_FIELDS = tuple(s.name for s in settings_table(ENGINE) if s.needs_reload)


@dataclass(frozen=True)
class Settings:
    """engine: EngineConfig without a store; sampling: defaults for the next message;
    current_model: path of the store the app opens (None = the bundled default model);
    app: the app's own settings (AppSettings: the colour scheme)."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)  # the settings table's defaults
    current_model: str | None = None
    app: AppSettings = field(default_factory=AppSettings)
    #: the file as read: keys this build does not know, a newer version, and (of a newer
    #: file) the known keys whose values this build refused, all written back by to_json
    kept: dict = field(default_factory=dict, compare=False, repr=False)

    def engine_config(self, store: str) -> EngineConfig:
        return replace(self.engine, store=store)

    def needs_reload(self, other: "Settings") -> bool:
        """True when switching from self to ``other`` requires reopening the engine."""
        if self.current_model != other.current_model:
            return True
        return any(getattr(self.engine, f) != getattr(other.engine, f) for f in RELOAD_FIELDS)

    def to_json(self) -> str:
        e = asdict(self.engine)
        e.pop("store", None)
        known = {"format": SETTINGS_FORMAT, "version": SETTINGS_VERSION, "engine": e,
                 "sampling": asdict(self.sampling), "current_model": self.current_model,
                 "app": asdict(self.app)}
        out = {}
        for key, value in known.items():
            if isinstance(value, dict):  # a section: this build's keys over the file's others
                value = {**self.kept.get(key, {}), **value}
                for name, (raw, default) in self.kept.get("refused", {}).get(key, {}).items():
                    if value.get(name) == default:  # not set by this build: the newer value stays
                        value[name] = raw
            out[key] = value
        out["version"] = max(SETTINGS_VERSION, self.kept.get("version", 0))
        for key, value in self.kept.get("top", {}).items():
            out.setdefault(key, value)
        return json.dumps(out, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Settings":
        """Parse and validate. Raises ValueError / ConfigError naming the bad setting (see
        :meth:`read` for the tolerant reading the app uses)."""
        settings, notes = cls.read(text, strict=True)
        return settings

    @classmethod
    def read(cls, text: str, strict: bool = False) -> tuple["Settings", list[str]]:
        """(settings, notes). Raises ValueError when ``text`` is not a settings file at all
        (not JSON, not an object, another format, a version that is not a whole number).
        Keys this build does not know are kept (:attr:`kept`); a newer version gives one note;
        a value out of range gives a note and its default. ``strict``: raise on those instead
        (ValueError / ConfigError naming the setting)."""
        d = json.loads(text)
        if not isinstance(d, dict) or d.get("format") != SETTINGS_FORMAT:
            raise ValueError("not a colibri-desktop settings file")
        version = d.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ValueError(f"settings version {version!r} is not a whole number >= 1")
        notes: list[str] = []
        newer = version > SETTINGS_VERSION
        if newer:
            if strict:
                raise ValueError(f"settings version {version!r} is not {SETTINGS_VERSION}")
            notes.append(f"the settings file was written by a newer colibri (settings version {version}, "
                         f"this one reads {SETTINGS_VERSION}): the settings this version knows are used, "
                         f"the others are kept in the file untouched")
        kept: dict = {"top": {k: v for k, v in d.items() if k not in _TOP_KEYS}, "refused": {}}
        if newer:
            kept["version"] = version

        def section(key: str, dc, group: str, fix=None):
            raw = d.get(key, {})  # absent in files written before the section existed
            if not isinstance(raw, dict):
                if strict or not newer:
                    raise ValueError(f"'{key}' must be an object")
                kept["top"][key] = raw
                raw = {}
            raw = upgrade_keys(raw, group) if group == ENGINE else dict(raw)
            if fix:
                raw = fix(raw)
            names = {f.name for f in fields(dc)} - {"store"}
            unknown = {k: v for k, v in raw.items() if k not in names}
            if unknown and strict:
                raise ValueError(f"unknown {key} settings: {', '.join(sorted(unknown))}")
            kept[key] = unknown
            table = {st.name: st for st in settings_table(group)}
            default = dc()
            good = {}
            for k, v in raw.items():
                if k not in names:
                    continue
                try:
                    good[k] = table[k].check(v) if k in table else v
                except ConfigError as e:
                    if strict:
                        raise
                    notes.append(f"{e}; its default {getattr(default, k)!r} is used")
                    if newer:  # a newer build may allow it: written back as it was
                        kept["refused"].setdefault(key, {})[k] = (v, getattr(default, k))
            try:
                obj = dc(**good)
                validate(obj, group)
            except (TypeError, ConfigError) as e:
                if strict:
                    raise
                notes.append(f"the {key} settings could not be used together ({e}); their defaults are used")
                obj = default
            return obj

        engine = section("engine", EngineConfig, ENGINE)
        sampling = section("sampling", SamplingParams, SAMPLING,
                           (lambda s: {**s, "seed": None} if s.get("seed") == 0 else s) if version == 1 else None)
        app = section("app", AppSettings, APP)
        cm = d.get("current_model")
        if cm is not None and not isinstance(cm, str):
            if strict:
                raise ValueError("'current_model' must be a path or null")
            notes.append(f"'current_model' = {cm!r} is not a path; the default model is used")
            cm = None
        return cls(engine=engine, sampling=sampling, current_model=cm, app=app, kept=kept), notes


_TOP_KEYS = ("format", "version", "engine", "sampling", "current_model", "app")


def settings_path() -> Path:
    """The settings file: ``user_config_dir()/settings.json``."""
    return library.user_config_dir() / FILENAME


def load_settings(path: Path | None = None) -> tuple[Settings, str | None]:
    """(settings, message). A missing file gives defaults and no message. A file that is not
    a settings file at all gives defaults and is moved aside (the message says where it went);
    one that cannot be read is left in place; a newer or partly invalid one is used for what
    this build can read (the message says what was not)."""
    p = path or settings_path()
    if not p.exists():
        return Settings(), None
    try:
        data = p.read_bytes()
    except OSError as e:
        return Settings(), (f"Settings file {p} could not be read ({e.strerror or e}); defaults are in effect "
                            f"and the file was left as it is.")
    try:
        settings, notes = Settings.read(data.decode("utf-8"))
    except ValueError as e:
        aside = p.with_name(p.name + f".bad-{time.strftime('%Y%m%d-%H%M%S')}")
        n = 1
        while aside.exists():  # never overwrite an earlier file kept aside
            aside = p.with_name(p.name + f".bad-{time.strftime('%Y%m%d-%H%M%S')}-{n}")
            n += 1
        try:
            os.replace(p, aside)
            where = f"kept as {aside} (rename it back to {p.name} to use it again once it is fixed)"
        except OSError:
            where = "left in place"
        return Settings(), f"Settings file {p} could not be used ({e}); defaults are in effect, the file was {where}."
    if not notes:
        return settings, None
    return settings, f"Settings file {p}: " + "; ".join(notes) + "."


def save_settings(s: Settings, path: Path | None = None) -> Path:
    """Write ``s`` atomically to the settings file.

    Raises:
        OSError: the file could not be written, or it exists and cannot be read now
            (permissions, an I/O error): what it holds was never read, so it is left as it is
            rather than replaced by these settings (the message says so).
    """
    p = path or settings_path()
    try:
        with p.open("rb"):
            pass
    except FileNotFoundError:
        pass
    except OSError as e:
        raise OSError(e.errno, f"{p} cannot be read ({e.strerror or e}); it is left as it is and these "
                               f"settings are not saved until it can be read") from None
    library.atomic_write_text(p, s.to_json())
    return p
