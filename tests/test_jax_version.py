"""jdist imports only on the JAX releases it is tested on, unless the user asks to try another."""

import pathlib
import re

import jax
import pytest
from packaging import specifiers

import jdist
from jdist._src import jax_version


def test_the_installed_jax_is_a_tested_release():
    assert jax_version.minor_release(jax.__version__) in jax_version.TESTED


@pytest.mark.parametrize("version", ["0.10.0", "0.10.2", "0.10.3.dev20260101", "0.10.1rc1",
                                     "0.12.0", "0.12.0.1", "0.12.3rc1"])
def test_a_tested_release_imports_silently(version, recwarn):
    jax_version.check(version, environ={})
    assert not recwarn.list


@pytest.mark.parametrize("version", ["0.9.2", "0.11.0", "0.11.2", "0.13.0", "0.13.0rc1", "1.0.0"])
def test_an_untested_release_raises_naming_the_way_out(version):
    with pytest.raises(jdist.errors.UnsupportedJaxError) as raised:
        jax_version.check(version, environ={})
    message = str(raised.value)
    assert f"jax {version}" in message and "jax 0.10 and 0.12 (jax>=0.10,<0.13,!=0.11.*)" in message
    assert 'pip install "jax>=0.10,<0.13,!=0.11.*" "jaxlib>=0.10,<0.13,!=0.11.*"' in message
    assert "JDIST_ALLOW_UNTESTED_JAX=1" in message
    assert isinstance(raised.value, ImportError)  # What an import guard catches.


@pytest.mark.parametrize("value", ["0", "", "yes"])
def test_only_the_override_set_to_1_lets_it_through(value):
    with pytest.raises(jdist.errors.UnsupportedJaxError):
        jax_version.check("0.13.0", environ={jax_version.OVERRIDE: value})


def test_the_override_warns_instead():
    with pytest.warns(UserWarning, match="jax 0.13.0, outside the releases it is tested on"):
        jax_version.check("0.13.0", environ={jax_version.OVERRIDE: "1"})


def test_an_unreadable_version_raises():
    with pytest.raises(jdist.errors.UnsupportedJaxError, match="cannot read"):
        jax_version.minor_release("dev")


def test_pip_installs_what_the_gate_admits():
    """pyproject.toml asks pip for the tested releases (`REQUIREMENT`), jax and jaxlib alike."""
    pyproject = (pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text()
    spec = jax_version.REQUIREMENT
    assert f'"jax{spec}", "jaxlib{spec}"' in pyproject
    for version in ["0.9.9", "0.10.0", "0.10.9", "0.11.0", "0.11.2", "0.12.0.1", "0.12.9", "0.13"]:
        tested = jax_version.minor_release(version) in jax_version.TESTED
        assert (version in specifiers.SpecifierSet(spec)) == tested, version


def test_only_jax_internals_imports_jax_src():
    """JAX's internals are used in one module, which says why for each (see its docstring)."""
    package = pathlib.Path(jax_version.__file__).parents[1]
    importing = sorted(str(path.relative_to(package)) for path in package.rglob("*.py")
                       if re.search(r"^\s*(from|import) jax\._src", path.read_text(), re.M))
    assert importing == ["_src/jax_internals.py"]
