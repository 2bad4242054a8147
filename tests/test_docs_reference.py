"""The docs are a reference: docs/plugins.md states the current release and plugin API wherever
it names a version, and lists every built-in entry point; no page but the benchmark results
(docs/benchmarks.md) reads like a lab diary (dated notes, working sessions)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
GUIDE = DOCS / "plugins.md"

# --------------------------------------------------------------------------- versions
# A mention of a version that says when something was added (`since plugin API 1.3`), or what
# a plugin in an example error was written for, is history, not a statement of the current one.
HISTORY = ("since ", "older than ", "written for corellm ", "needs corellm ")
RELEASE = re.compile(r"\bcorellm (\d+\.\d+(?:\.\d+)?)\b")
API = re.compile(r"\bplugin API (\d+\.\d+)\b")
PIN = re.compile(r"\bcorellm>=([\d.]+),<([\d.]+)")
JSON_API = re.compile(r'"plugin_api": "(\d+\.\d+)"')


def stale_versions(text: str, release: str, api: str) -> list[str]:
    """Every version ``text`` states that is not ``release`` (major.minor.patch) or ``api``
    (major.minor), as the text around it."""
    major_minor = ".".join(release.split(".")[:2])
    major, minor = map(int, major_minor.split("."))
    pin = (major_minor, f"{major}.{minor + 1}")
    bad = []

    def where(m: re.Match) -> str:
        return text[max(0, m.start() - 40):m.end() + 10].replace("\n", " ")

    for m in RELEASE.finditer(text):
        if m[1] not in (release, major_minor):
            bad.append(where(m))
    for m in API.finditer(text):
        if not text[:m.start()].endswith(HISTORY) and m[1] != api:
            bad.append(where(m))
    for m in PIN.finditer(text):
        if (m[1], m[2]) != pin:
            bad.append(where(m))
    for m in JSON_API.finditer(text):
        if m[1] != api:
            bad.append(where(m))
    return bad


def builtin_entry_points_listed(text: str) -> dict[str, str]:
    """The entry points of the ```toml block of the guide's "Discovery" section that registers
    ``corellm_plugins`` modules."""
    section = re.search(r"^## Discovery\n(.*?)(?=^## )", text, flags=re.DOTALL | re.MULTILINE)
    assert section is not None, "docs/plugins.md has no '## Discovery' section"
    for block in re.findall(r"^```toml\n(.*?)^```", section[1], flags=re.DOTALL | re.MULTILINE):
        table = tomllib.loads(block)["project"]["entry-points"]["corellm"]
        if any(v.startswith("corellm_plugins.") for v in table.values()):
            return table
    raise AssertionError("the Discovery section lists no built-in entry points")


def test_plugin_guide_states_the_current_versions_and_every_builtin():
    from corellm import __version__
    from corellm.plugins import PLUGIN_API_VERSION

    api = ".".join(map(str, PLUGIN_API_VERSION))
    # The check finds a stale statement, and lets history and the current ones through.
    planted = ("this corellm 0.4.3 provides plugin API 1.3 (since plugin API 1.3); "
               'depends on corellm>=0.4,<0.5, "plugin_api": "1.3"')
    assert len(stale_versions(planted, __version__, api)) == 4
    current = f"corellm {__version__} provides plugin API {api}"
    assert stale_versions(current, __version__, api) == []

    text = GUIDE.read_text()
    assert stale_versions(text, __version__, api) == []
    assert f"corellm {__version__}" in text and f"plugin API {api}" in text, \
        "docs/plugins.md must name the current release and plugin API somewhere"

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert builtin_entry_points_listed(text) == project["project"]["entry-points"]["corellm"]


# --------------------------------------------------------------------------- no diary
DIARY = re.compile(
    r"\b(?:first|second|third|fourth|fifth|sixth|this|that|last|previous) session\b"
    r"|\b[Rr]e-?measured on\b|\b[Tt]ried (?:again )?(?:on|later)\b|\badded on 20\d\d"
    r"|\blater that day\b|\(20\d\d-\d\d-\d\d\)")


def test_no_page_reads_like_a_lab_diary():
    planted = ["**Re-measured on 2026-11-26 (fourth session):** ...",
               "Tried on 2026-11-26 and not kept", "Tried again later that day",
               "(`attention.prefill`; added on 2026-11-26)", "prefetched (2026-11-26)",
               "Rewrites tried that session"]
    assert all(DIARY.search(s) for s in planted)
    # Chat sessions and results captions are not diary.
    assert not DIARY.search("multi-turn chat sessions, `session_id`, `--sharegpt-sessions`; "
                            "2026-11-23, AMD EPYC, 2 cores: `python3 benchmarks/x.py`")

    found = []
    for page in sorted(DOCS.glob("*.md")):
        if page.name == "benchmarks.md":
            continue
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if m := DIARY.search(line):
                found.append(f"{page.relative_to(REPO)}:{n}: {m[0]!r} in {line.strip()[:100]}")
    assert not found, "dated notes or session words:\n" + "\n".join(found)
