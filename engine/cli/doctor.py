"""``colibri --version`` and ``colibri doctor``: what a bug report needs, in one paste.

``colibri doctor`` prints: the colibri version and how it is installed (source / pip or the
frozen bundle, with its BUILDINFO), Python and the OS, the versions of the libraries the engine
runs on (read from package metadata: PySide6 is never imported, so no Qt starts), the CPU and
its SIMD features (AVX2, AVX-512, VNNI: what LLVM sees, the int kernel path chosen), whether
the desktop window can open (a display, the shared libraries Qt needs: engine.gui_check, with
the install command for what is missing), the
threads (numba's threading layer, the default thread count from CPU affinity and the cgroup
CPU quota, the settings file's choice), numba's cache folder, RAM (host and cgroup limit,
engine.sysinfo), the data and config folders (writable or not, free disk), a short disk read
test on the data folder (uncached reads of a temp file; bounded in bytes and seconds; the file
is always removed), and the models found (engine.library). Every section is independent: a
failure is printed on its line, never a traceback; the exit code is 0 unless the output itself
cannot be written. ``--json`` prints the same facts as one JSON object.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from .. import __version__
from ..library.disk import BLOCK, DISK_TEST_BYTES, DISK_TEST_SECONDS, DiskSpeed, disk_read_speed  # noqa: F401 - here too
from ..units import format_bytes

APP = "colibri-desktop"
# (label, distribution names tried in order); versions come from package metadata only
PACKAGES = (("numpy", ("numpy",)), ("numba", ("numba",)), ("llvmlite", ("llvmlite",)),
            ("PySide6", ("PySide6-Essentials", "PySide6")), ("pyqtgraph", ("pyqtgraph",)),
            ("tokenizers", ("tokenizers",)), ("safetensors", ("safetensors",)), ("jinja2", ("Jinja2", "jinja2")),
            ("huggingface_hub", ("huggingface-hub", "huggingface_hub")), ("platformdirs", ("platformdirs",)),
            ("psutil", ("psutil",)), ("ml_dtypes", ("ml-dtypes", "ml_dtypes")))
# LLVM feature names worth a line in a bug report (x86 SIMD the kernels care about; NEON on ARM)
CPU_FLAGS = ("sse4.2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512vnni",
             "avxvnni", "avx512bf16", "amx-int8", "neon", "dotprod")
def is_frozen() -> bool:
    """True inside the PyInstaller bundle."""
    return bool(getattr(sys, "frozen", False))


def version_line() -> str:
    """``colibri --version``: one line, cheap (no numba, no Qt)."""
    how = "bundle" if is_frozen() else "python"
    return (f"{APP} {__version__} ({how}; Python {platform.python_version()}, {platform.system()} "
            f"{platform.machine()})")


def package_versions() -> dict[str, str]:
    """{label: version or "not installed"} from package metadata (nothing is imported)."""
    from importlib import metadata
    out = {}
    for label, dists in PACKAGES:
        v = "not installed"
        for d in dists:
            try:
                v = metadata.version(d)
                break
            except metadata.PackageNotFoundError:
                continue
        out[label] = v
    return out


def _writable(folder: Path) -> tuple[bool, str]:
    """(can files be created in ``folder``, why not) by creating and removing one."""
    try:
        fd, p = tempfile.mkstemp(prefix=".colibri-doctor-", dir=folder)
        os.close(fd)
        os.unlink(p)
        return True, ""
    except OSError as e:
        return False, str(e.strerror or e)


def _folder_fact(p: Path, env: str | None = None, what: str = "data") -> dict:
    """{path, exists, writable, problem, not_a_folder, free_bytes} of a user folder; a path
    that is (or lies under) a file is ``not_a_folder`` with the library's sentence saying what
    to do (engine.library.folder_problem)."""
    from ..library import folder_problem, free_space
    d: dict = {"path": str(p), "exists": p.is_dir(), "not_a_folder": False}
    if d["exists"]:
        d["writable"], why = _writable(p)
        if why:
            d["problem"] = why
    else:
        d["writable"] = False
        why = folder_problem(p, env, what)
        d["not_a_folder"] = why is not None
        d["problem"] = why or "not created yet"
    try:
        d["free_bytes"] = free_space(p)
    except OSError as e:
        d["free_bytes"] = None
        d.setdefault("problem", str(e))
    return d


def _settings_threads(config_dir: Path) -> int | None:
    """The ``threads`` engine setting saved by the app (None when unset or unreadable)."""
    try:
        d = json.loads((config_dir / "settings.json").read_text(encoding="utf-8"))
        v = d.get("engine", {}).get("threads", d.get("engine", {}).get("numba_threads"))
        return int(v) if v is not None else None
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def _section(facts: dict, key: str, fn) -> None:
    try:
        facts[key] = fn()
    except Exception as e:  # noqa: BLE001 - a report must go on past any one failure
        facts[key] = {"error": f"{type(e).__name__}: {e}"}


def collect(disk_test: bool = True, budget_bytes: int = DISK_TEST_BYTES,
            budget_s: float = DISK_TEST_SECONDS) -> dict:
    """Every fact of the report as plain JSON-able data (see the module doc). Never raises."""
    from ..library import DEFAULT_MODEL, default_model_dir, list_models, user_config_dir, user_data_dir
    facts: dict = {"colibri": {"version": __version__, "install": "bundle" if is_frozen() else "python",
                               "location": str(Path(__file__).resolve().parents[2])}}
    if is_frozen():
        try:
            bundle = getattr(sys, "_MEIPASS")  # PyInstaller's documented bundle folder
            info = json.loads((Path(bundle) / "BUILDINFO.json").read_text(encoding="utf-8"))
            facts["colibri"]["build"] = {k: info.get(k) for k in ("platform", "arch", "source_date_epoch")}
        except (OSError, ValueError, AttributeError):
            facts["colibri"]["build"] = None
    facts["python"] = {"version": platform.python_version(), "implementation": platform.python_implementation(),
                       "executable": sys.executable}
    facts["os"] = {"platform": platform.platform(), "machine": platform.machine()}
    _section(facts, "packages", package_versions)

    def cpu():
        from .. import kernel_facts as K  # what the kernels will use, without starting numba
        from ..sysinfo import affinity_cpus, cgroup_cpu_quota, cpu_name, usable_cpus
        feats = K.cpu_features()
        try:
            t = K.kernel_target()
            target = {"level": t.level, "cpu_name": t.cpu_name}
        except ValueError as e:
            t, target = None, {"level": None, "problem": str(e)}
        return {"name": cpu_name(), "logical_cpus": os.cpu_count(), "affinity_cpus": affinity_cpus(),
                "cgroup_cpu_quota": cgroup_cpu_quota(), "usable_cpus": usable_cpus(),
                "features": {f: feats[f] for f in CPU_FLAGS if f in feats},
                "int_kernels": K.int_flavor(t), "kernel_target": target}
    _section(facts, "cpu", cpu)

    def threads():
        from .. import kernel_facts as K
        from ..settings import EngineConfig
        from ..sysinfo import usable_cpus
        default = EngineConfig().threads or usable_cpus()
        try:
            saved = _settings_threads(user_config_dir(create=False))
        except OSError:
            saved = None
        layer = K.threading_layer()
        cache, cache_problem = K.numba_cache_dir()
        try:
            from ..kernel_cache import shipped_status
            prebuilt = shipped_status(cache, K.kernel_target())
        except ValueError as e:  # a bad COLIBRI_KERNEL_TARGET
            prebuilt = f"none: {e}"
        return {"threading_layer": layer, "serialized": layer not in ("omp", "tbb"), "default": default,
                "settings_file": saved, "in_use": saved or default,  # 0 = all usable CPUs
                "limit": K.thread_limit(),
                "numba_cache": cache, "numba_cache_problem": cache_problem, "prebuilt_kernels": prebuilt}
    _section(facts, "threads", threads)

    def memory():
        from ..sysinfo import cgroup_memory
        from ..sysinfo import memory as mem
        total, avail = mem()
        cg = cgroup_memory()
        return {"total_bytes": total, "available_bytes": avail,
                "cgroup": None if cg is None else {"limit_bytes": cg.limit, "usage_bytes": cg.usage,
                                                   "available_bytes": cg.available, "version": cg.version,
                                                   "path": cg.path}}
    _section(facts, "memory", memory)

    def window():
        from ..gui_check import check_gui
        chk = check_gui()
        return {"ok": chk.ok, "platform": chk.platform, "display": chk.display, "display_ok": chk.display_ok,
                "missing": sorted(chk.missing), "install": chk.install, "message": chk.message()}
    _section(facts, "window", window)

    data = user_data_dir(create=False)
    config = user_config_dir(create=False)
    _section(facts, "data_folder", lambda: _folder_fact(data, "COLIBRI_DATA_DIR", "models, downloads and chats"))
    _section(facts, "config_folder", lambda: _folder_fact(config, "COLIBRI_CONFIG_DIR", "settings"))

    def models():
        out = {"models_folder": str(data / "models"), "converted": [], "default_model": {}}
        src = default_model_dir()
        out["default_model"] = {"name": DEFAULT_MODEL, "bundled": (src / "config.json").is_file(), "path": str(src)}
        from ..library import folder_problem
        why = folder_problem(data / "models", None, "converted models")
        if why:
            out["problem"] = why
        elif (data / "models").is_dir():  # never create folders just to report them
            try:
                out["converted"] = [{"name": m.name, "quant": m.quantization, "family": m.family_label,
                                     "size_bytes": m.size_bytes, "path": m.path, "ok": m.ok,
                                     "problem": m.problem, "advice": m.advice} for m in list_models()]
            except OSError as e:
                out["problem"] = str(e)
        return out
    _section(facts, "models", models)

    if disk_test:
        def disk():
            expert_files = []
            for m in facts.get("models", {}).get("converted", []):
                expert_files += sorted(Path(m["path"]).glob("experts/*.bin"))
            where = data
            while not where.is_dir() and where != where.parent:  # not created yet: the disk it will be on
                where = where.parent
            r = disk_read_speed(where, expert_files, budget_bytes, budget_s)
            d = asdict(r)
            d["mb_per_s"] = r.mb_per_s
            return d
        _section(facts, "disk_read", disk)
    return facts


def _yes(b) -> str:
    return "yes" if b else "no"


def format_report(f: dict) -> str:
    """The plain-text report of :func:`collect`'s facts (one labelled line per fact)."""
    L: list[str] = []

    def add(label: str, text: str) -> None:
        L.append(f"{label:<13}{text}")

    def err(sec: str) -> str | None:
        v = f.get(sec)
        return v["error"] if isinstance(v, dict) and "error" in v else None

    c = f["colibri"]
    add("colibri", f"{APP} {c['version']} ({'PyInstaller bundle' if c['install'] == 'bundle' else 'Python install'}"
        f" at {c['location']})")
    if c.get("build"):
        b = c["build"]
        when = b.get("source_date_epoch")
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(when)) if isinstance(when, int) else "?"
        add("build", f"{b.get('platform')} {b.get('arch')}, sources of {when}")
    add("python", f"{f['python']['version']} ({f['python']['implementation']}, {f['python']['executable']})")
    add("os", f"{f['os']['platform']} ({f['os']['machine']})")
    if err("packages"):
        add("packages", err("packages"))
    else:
        add("packages", ", ".join(f"{k} {v}" for k, v in f["packages"].items()))
    if err("cpu"):
        add("cpu", err("cpu"))
    else:
        cpu = f["cpu"]
        q = cpu["cgroup_cpu_quota"]
        add("cpu", f"{cpu['name']}; {cpu['usable_cpus']} usable of {cpu['logical_cpus']} logical "
            f"(affinity {cpu['affinity_cpus']}, cgroup quota {'none' if q is None else f'{q:g} CPUs'})")
        feats = cpu["features"]
        add("cpu features", (", ".join(f"{k} {_yes(v)}" for k, v in feats.items()) or "unknown")
            + f"; int8/int4 kernels: {cpu['int_kernels']}")
        kt = cpu.get("kernel_target") or {}
        add("cpu target", kt.get("problem") or (
            f"{kt['level']} (the kernels are built for this x86-64 level, not this exact CPU)"
            if kt.get("level") not in (None, "host", "user") else f"{kt.get('cpu_name')} ({kt.get('level')})"))
    if err("threads"):
        add("threads", err("threads"))
    else:
        t = f["threads"]
        saved = t["settings_file"]
        add("threads", f"{t['in_use']} for the kernels (default {t['default']}: all usable CPUs"
            + (f"; settings file says {saved}" if saved is not None else "") + f"; at most {t['limit']}), "
            f"numba threading layer {t['threading_layer']}" + (" (serialized)" if t["serialized"] else ""))
        add("numba cache", t["numba_cache"] or "none: " + (t.get("numba_cache_problem") or
                                                           "no writable cache folder, kernels compile at every start"))
        add("pre-built", t.get("prebuilt_kernels") or "unknown")
    if err("memory"):
        add("memory", err("memory"))
    else:
        m = f["memory"]
        add("memory", f"{format_bytes(m['available_bytes'])} available of {format_bytes(m['total_bytes'])}")
        cg = m["cgroup"]
        add("cgroup", "no memory limit" if cg is None else
            f"limit {format_bytes(cg['limit_bytes'])} (v{cg['version']}, {cg['path']}), "
            f"{format_bytes(cg['available_bytes'])} left")
    if err("window"):
        add("window", err("window"))
    elif "window" in f:
        w = f["window"]
        if w["ok"]:
            add("window", f"can open ({w['platform']}" + (f" on {w['display']}" if w["display"] else "")
                + "; the libraries Qt needs load)")
        else:
            for i, line in enumerate(x for x in w["message"].splitlines() if x.strip()):
                add("window" if i == 0 else "", line.strip() if i else line)
    for key, label in (("data_folder", "data folder"), ("config_folder", "config")):
        if err(key):
            add(label, err(key))
            continue
        d = f[key]
        state = ("writable" if d["writable"] else f"NOT A FOLDER: {d['problem']}" if d.get("not_a_folder") else
                 "not created yet" if not d["exists"] else f"NOT writable ({d.get('problem', '?')})")
        free = "" if d.get("free_bytes") is None else f", {format_bytes(d['free_bytes'])} free"
        add(label, f"{d['path']} ({state}{free})")
    if "disk_read" in f:
        if err("disk_read"):
            add("disk read", err("disk_read"))
        else:
            r = f["disk_read"]
            if r["mb_per_s"] is None:
                add("disk read", r["note"] or "not measured")
            else:
                add("disk read", f"{r['mb_per_s']:.0f} MB/s ({format_bytes(r['bytes_read'])} in {r['seconds']:.2f} s, "
                    f"{r['method']}, 1 MiB reads at random offsets, on {r['path']})"
                    + (f"; {r['note']}" if r["note"] else ""))
    if err("models"):
        add("models", err("models"))
    else:
        mo = f["models"]
        dm = mo["default_model"]
        add("default", f"{dm['name']}: " + (f"bundled at {dm['path']}" if dm["bundled"] else
                                            f"MISSING from {dm['path']} (broken install)"))
        conv = mo["converted"]
        if not conv:
            add("models", f"none converted in {mo['models_folder']}" + (f" ({mo['problem']})" if mo.get("problem") else ""))
        for i, m in enumerate(conv):
            add("models" if i == 0 else "", f"{m['name']} {m['quant']} {m['family']} {format_bytes(m['size_bytes'])}  "
                f"{m['path']}" + ("" if m.get("ok", True) else "  BROKEN"))
            if not m.get("ok", True):
                add("", f"  {m['problem']}")
                add("", f"  {m['advice']}")
    return "\n".join(L)


def cmd_doctor(a) -> int:
    """``colibri doctor``: print the report (``--json``: as JSON)."""
    facts = collect(disk_test=not a.no_disk_test, budget_bytes=a.disk_test_mb << 20)
    print(json.dumps(facts, indent=1) if a.json else format_report(facts))
    return 0


def _test_mb(text: str) -> int:
    import argparse
    try:
        v = int(text)
    except ValueError:
        v = 0
    if not 1 <= v <= 1024:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of MB from 1 to 1024")
    return v


def add_parsers(sub) -> None:
    """Add ``doctor`` to the ``colibri`` argparse subparsers ``sub``."""
    d = sub.add_parser("doctor", help="print what a bug report needs (versions, CPU, RAM, disk speed, models)",
                       description="Versions, CPU features, threads, RAM and the cgroup limit, the data and "
                                   "config folders, a short disk read test on the data folder and the models "
                                   "found. Paste the output into a bug report.")
    d.add_argument("--json", action="store_true", help="print the facts as one JSON object")
    d.add_argument("--no-disk-test", action="store_true", help="skip the disk read test")
    d.add_argument("--disk-test-mb", type=_test_mb, default=DISK_TEST_BYTES >> 20, metavar="MB",
                   help="size of the disk test file (1-1024; default %(default)s)")
    d.set_defaults(fn=cmd_doctor)
