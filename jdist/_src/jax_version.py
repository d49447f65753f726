"""The JAX releases jdist is tested on, checked when jdist is imported.

jdist reads JAX's programs, not only runs them: which outputs are `Mirrored` (`invariance`),
and where an exact step is cut (`uneven_trace`) are
analyses of jaxprs, keyed on primitive names and parameters that JAX changes between minor
releases. An analysis that meets an unknown parameter raises; one that meets a renamed
primitive may not, and could mark a value that differs per replica as `Mirrored`: a wrong
number. So an untested JAX is refused at import, loudly, unless the user asks to try it.

The whole suite runs on both releases in CI (``.ci/run``): jax 0.10 on Python 3.11
(``make test``) and the newest jax 0.12 on Python 3.13 (``make test-py313``). jax 0.11 is left
out: its XLA CPU compiler crashes the process (a segmentation fault) on a ``jit(shard_map)``
program that takes a zero-size array (2026-11-28, jax 0.11.2: ``lambda a, b: a.sum() + b.sum()``
with ``b`` of shape ``(0,)``; 0.12.0.1 returns the sum), which a partial batch's empty replicas
give. Also measured on 0.11.2 (2026-11-26): ``lax.scan``'s parameters changed (``num_consts``
and ``num_carry`` became ``ft_in``; `invariance.scan_counts` reads both since 2026-11-27).
"""

import os
import re
import warnings

from jdist._src import errors

TESTED = ((0, 10), (0, 12))  # The minor releases tested, each with all its patch releases.
REQUIREMENT = ">=0.10,<0.13,!=0.11.*"  # TESTED as pip reads it: pyproject.toml's jax and jaxlib.
OVERRIDE = "JDIST_ALLOW_UNTESTED_JAX"  # Set to 1 to import jdist on another JAX anyway.


def minor_release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a JAX version string such as ``"0.10.2"`` or ``"0.11.0.dev1"``.

    Example:
      >>> minor_release("0.10.2"), minor_release("0.12.0.1"), minor_release("0.13.0rc1")
      ((0, 10), (0, 12), (0, 13))
    """
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise errors.UnsupportedJaxError(f"cannot read the JAX version {version!r}")
    return int(found.group(1)), int(found.group(2))


def check(version: str, environ=os.environ) -> None:
    """Raises `errors.UnsupportedJaxError` where ``version`` is not of a tested minor release
    (`TESTED`), unless ``environ`` sets `OVERRIDE` to 1: then it warns, once per import.

    Args:
      version: the installed JAX's ``jax.__version__``.
      environ: the environment to read `OVERRIDE` from.

    Example:
      >>> check("0.10.2"), check("0.12.0.1")  # Tested: nothing happens.
      (None, None)
      >>> check("0.11.2", environ={})
      Traceback (most recent call last):
      ...
      jdist._src.errors.UnsupportedJaxError: jdist is tested on jax 0.10 and 0.12 ...
    """
    if minor_release(version) in TESTED:
        return
    tested = " and ".join(f"{major}.{minor}" for major, minor in TESTED)
    tested = f"jax {tested} (jax{REQUIREMENT})"
    if environ.get(OVERRIDE) == "1":
        warnings.warn(f"jdist runs on jax {version}, outside the releases it is tested on "
                      f"({tested}), because {OVERRIDE}=1: its analyses of JAX's programs may "
                      "fail or be wrong there.", UserWarning, stacklevel=2)
        return
    raise errors.UnsupportedJaxError(
        f"jdist is tested on {tested}, and this is jax {version}. jdist analyses JAX's "
        "programs (which values are Mirrored, where a partial batch's step is cut), and those "
        "change between JAX releases, so an untested one could give wrong numbers or crash. "
        f"Install a tested release: pip install \"jax{REQUIREMENT}\" \"jaxlib{REQUIREMENT}\". "
        f"To try this one anyway, at your own risk, set {OVERRIDE}=1.")
