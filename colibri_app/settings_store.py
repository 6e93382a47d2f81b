"""The app's persisted settings: engine settings, sampling defaults, current model.

One versioned JSON file in the user config directory (platformdirs), written atomically.
An unreadable or out-of-range file falls back to defaults with a message, and is kept aside
as ``settings.json.bad-<time>`` (never overwritten silently).
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
        return json.dumps({"format": SETTINGS_FORMAT, "version": SETTINGS_VERSION, "engine": e,
                           "sampling": asdict(self.sampling), "current_model": self.current_model,
                           "app": asdict(self.app)},
                          indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Settings":
        """Parse and validate. Raises ValueError / ConfigError naming the bad setting."""
        d = json.loads(text)
        if not isinstance(d, dict) or d.get("format") != SETTINGS_FORMAT:
            raise ValueError("not a colibri-desktop settings file")
        version = d.get("version")
        if version not in (1, SETTINGS_VERSION):
            raise ValueError(f"settings version {version!r} is not {SETTINGS_VERSION}")
        e = d.get("engine", {})
        if not isinstance(e, dict):
            raise ValueError("'engine' must be an object")
        e = upgrade_keys(e, ENGINE)  # e.g. numba_threads (before 0.2) -> threads
        names = {f.name for f in fields(EngineConfig)} - {"store"}
        unknown = set(e) - names
        if unknown:
            raise ValueError(f"unknown engine settings: {', '.join(sorted(unknown))}")
        engine = EngineConfig(**e).validated()
        s = d.get("sampling", {})
        snames = {f.name for f in fields(SamplingParams)}
        if not isinstance(s, dict) or set(s) - snames:
            raise ValueError("'sampling' has unknown keys")
        if version == 1 and s.get("seed") == 0:
            s = {**s, "seed": None}
        sampling = SamplingParams(**s)
        validate(sampling, SAMPLING)
        cm = d.get("current_model")
        if cm is not None and not isinstance(cm, str):
            raise ValueError("'current_model' must be a path or null")
        a = d.get("app", {})  # absent in files written before the app settings existed
        anames = {f.name for f in fields(AppSettings)}
        if not isinstance(a, dict) or set(a) - anames:
            raise ValueError("'app' has unknown keys")
        app = AppSettings(**a)
        validate(app, APP)
        return cls(engine=engine, sampling=sampling, current_model=cm, app=app)


def settings_path() -> Path:
    """The settings file: ``user_config_dir()/settings.json``."""
    return library.user_config_dir() / FILENAME


def load_settings(path: Path | None = None) -> tuple[Settings, str | None]:
    """(settings, message). A missing file gives defaults and no message; a bad file gives
    defaults, is moved aside, and the message says where it went and why."""
    p = path or settings_path()
    if not p.exists():
        return Settings(), None
    try:
        return Settings.from_json(p.read_text(encoding="utf-8")), None
    except (OSError, ValueError, TypeError, ConfigError) as e:
        aside = p.with_name(p.name + f".bad-{time.strftime('%Y%m%d-%H%M%S')}")
        n = 1
        while aside.exists():  # never overwrite an earlier file kept aside
            aside = p.with_name(p.name + f".bad-{time.strftime('%Y%m%d-%H%M%S')}-{n}")
            n += 1
        try:
            os.replace(p, aside)
            where = f"kept as {aside}"
        except OSError:
            where = "left in place"
        return Settings(), f"Settings file {p} could not be used ({e}); defaults are in effect, the file was {where}."


def save_settings(s: Settings, path: Path | None = None) -> Path:
    p = path or settings_path()
    library.atomic_write_text(p, s.to_json())
    return p
