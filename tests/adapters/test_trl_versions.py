"""``check_versions()``: a clear error outside the supported trl / transformers range, silence inside it."""

from __future__ import annotations

import importlib.metadata

import pytest

from rl_guard.adapters.trl import SUPPORTED, RLGuardCallback, check_versions


def _fake_versions(monkeypatch, **versions):
    real = importlib.metadata.version

    def version(name):
        if name in versions:
            if versions[name] is None:
                raise importlib.metadata.PackageNotFoundError(name)
            return versions[name]
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)


def test_installed_versions_are_supported():
    check_versions()


@pytest.mark.parametrize("pkg,version", [("trl", "0.19.1"), ("trl", "2.0.0"), ("transformers", "4.57.3"),
                                         ("transformers", "6.1.0"), ("trl", "unknown")])
def test_unsupported_version_raises_a_clear_message(monkeypatch, pkg, version):
    _fake_versions(monkeypatch, **{pkg: version})
    lo, hi = SUPPORTED[pkg]
    with pytest.raises(RuntimeError) as err:
        check_versions()
    message = str(err.value)
    assert f"found {pkg} {version}" in message
    assert f">= {lo[0]}.{lo[1]}" in message and f"< {hi[0]}.{hi[1]}" in message
    with pytest.raises(RuntimeError, match=f"found {pkg} {version}"):
        RLGuardCallback("rules: []\n")  # the callback checks before doing anything else


@pytest.mark.parametrize("version", ["1.16.0", "1.0.0", "1.99.2.dev0", "1.5.0rc1", "1.0rc1"])
def test_supported_trl_versions_pass(monkeypatch, version):
    _fake_versions(monkeypatch, trl=version)
    check_versions()


def test_plain_transformers_without_trl_is_fine(monkeypatch):
    _fake_versions(monkeypatch, trl=None)
    check_versions()


def test_missing_transformers_is_reported(monkeypatch):
    _fake_versions(monkeypatch, transformers=None)
    with pytest.raises(importlib.metadata.PackageNotFoundError, match=r"needs transformers >= 5\.0, < 6\.0; "
                       "transformers is not installed"):
        check_versions()
