"""jdist imports only on the JAX releases it is tested on, unless the user asks to try another."""

import jax
import pytest

import jdist
from jdist._src import jax_version


def test_the_installed_jax_is_a_tested_release():
    low, high = jax_version.TESTED
    assert low <= jax_version.minor_release(jax.__version__) < high


@pytest.mark.parametrize("version", ["0.10.0", "0.10.2", "0.10.3.dev20260101", "0.10.1rc1"])
def test_a_tested_release_imports_silently(version, recwarn):
    jax_version.check(version, environ={})
    assert not recwarn.list


@pytest.mark.parametrize("version", ["0.9.2", "0.11.0", "0.11.2", "0.12.0.1", "1.0.0"])
def test_an_untested_release_raises_naming_the_way_out(version):
    with pytest.raises(jdist.errors.UnsupportedJaxError) as raised:
        jax_version.check(version, environ={})
    message = str(raised.value)
    assert f"jax {version}" in message and "jax>=0.10,<0.11" in message
    assert "JDIST_ALLOW_UNTESTED_JAX=1" in message
    assert isinstance(raised.value, ImportError)  # What an import guard catches.


@pytest.mark.parametrize("value", ["0", "", "yes"])
def test_only_the_override_set_to_1_lets_it_through(value):
    with pytest.raises(jdist.errors.UnsupportedJaxError):
        jax_version.check("0.11.2", environ={jax_version.OVERRIDE: value})


def test_the_override_warns_instead():
    with pytest.warns(UserWarning, match="jax 0.11.2, outside the releases it is tested on"):
        jax_version.check("0.11.2", environ={jax_version.OVERRIDE: "1"})


def test_an_unreadable_version_raises():
    with pytest.raises(jdist.errors.UnsupportedJaxError, match="cannot read"):
        jax_version.minor_release("dev")
