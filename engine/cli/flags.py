"""Command-line flags derived from the settings table (engine.settings): ``--a-b`` for the
setting ``a_b``, the same name as the settings-file key; booleans as ``--x`` / ``--no-x``."""

from __future__ import annotations

import argparse

from ..settings import ENGINE, SAMPLING, EngineConfig, SamplingParams, Setting, settings_table

GROUP_TITLES = {ENGINE: "engine (speed and memory: never changes the output, but --context-length sets what "
                        "fits: history and looked-up entries beyond it are left out)", SAMPLING: "sampling"}


def _value_parser(s: Setting):
    def parse(text: str):
        if s.auto and text.strip().lower() == "auto":
            return None
        try:
            v = s.type(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'a whole number' if s.type is int else 'a number'}"
                                             + (" or auto" if s.auto else "")) from None
        return v
    parse.__name__ = s.type.__name__  # argparse names the type in its messages
    return parse


def add_setting_flags(p: argparse.ArgumentParser, group: str) -> None:
    """Add one flag per setting of ``group`` (ENGINE or SAMPLING) to ``p``; defaults from the table."""
    g = p.add_argument_group(GROUP_TITLES.get(group, group))
    for s in settings_table(group):
        names = [s.flag] + ["--" + o.replace("_", "-") for o in s.old_names]
        default = "auto" if s.default is None else ({True: "on", False: "off"}.get(s.default, s.default)
                                                    if s.type is bool else s.default)
        text = (f"{s.help} ({s.flag} or --no-{s.flag[2:]}, no value; default: {default})" if s.type is bool
                else f"{s.help} ({s.range_text()}; default: {default})")
        if s.type is bool:
            g.add_argument(*names, dest=s.name, action=argparse.BooleanOptionalAction, default=s.default,
                           help=text.replace("%", "%%"))
        else:
            g.add_argument(*names, dest=s.name, type=_value_parser(s), default=s.default,
                           choices=s.choices or None, metavar=None if s.choices else ("N" if s.type is int else "X") + ("|auto" if s.auto else ""),
                           help=text.replace("%", "%%"))


def values(a: argparse.Namespace, group: str) -> dict:
    """{setting name: value} of ``group`` from parsed flags."""
    return {s.name: getattr(a, s.name) for s in settings_table(group)}


def engine_config(a: argparse.Namespace, store: str) -> EngineConfig:
    """The validated EngineConfig the flags describe. Raises ConfigError naming the setting."""
    return EngineConfig(store=store, **values(a, ENGINE)).validated()


def sampling_params(a: argparse.Namespace) -> SamplingParams:
    """The validated SamplingParams the flags describe. Raises ConfigError naming the setting."""
    from ..settings import validate
    sp = SamplingParams(**values(a, SAMPLING))
    validate(sp, SAMPLING)
    return sp
