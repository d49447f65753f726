"""The JAX releases jdist is tested on, checked when jdist is imported.

jdist reads JAX's programs, not only runs them: which outputs are `Mirrored` (`invariance`),
which axes are batch rows (`batch_rows`) and where an exact step is cut (`uneven_trace`) are
analyses of jaxprs, keyed on primitive names and parameters that JAX changes between minor
releases. An analysis that meets an unknown parameter raises; one that meets a renamed
primitive may not, and could mark a value that differs per replica as `Mirrored`: a wrong
number. So an untested JAX is refused at import, loudly, unless the user asks to try it.

Measured on jax 0.11.2 (2026-11-26): ``lax.scan``'s parameters changed (``num_consts`` and
``num_carry`` became ``ft_in``; `invariance.scan_counts` reads both since 2026-11-27), and
XLA's CPU compiler crashed the process (a segmentation fault) on a ``jit(shard_map)`` program
that takes a zero-size array, which a partial batch's empty replicas give.
"""

import os
import re
import warnings

from jdist._src import errors

TESTED = ((0, 10), (0, 11))  # The JAX releases tested: from 0.10 up to, not including, 0.11.
OVERRIDE = "JDIST_ALLOW_UNTESTED_JAX"  # Set to 1 to import jdist on another JAX anyway.


def minor_release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a JAX version string such as ``"0.10.2"`` or ``"0.11.0.dev1"``.

    Example:
      >>> minor_release("0.10.2"), minor_release("0.12.0.1"), minor_release("0.11.0rc1")
      ((0, 10), (0, 12), (0, 11))
    """
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise errors.UnsupportedJaxError(f"cannot read the JAX version {version!r}")
    return int(found.group(1)), int(found.group(2))


def check(version: str, environ=os.environ) -> None:
    """Raises `errors.UnsupportedJaxError` where ``version`` is outside the tested releases
    (`TESTED`), unless ``environ`` sets `OVERRIDE` to 1: then it warns, once per import.

    Args:
      version: the installed JAX's ``jax.__version__``.
      environ: the environment to read `OVERRIDE` from.

    Example:
      >>> check("0.10.2")  # Tested: nothing happens.
      >>> check("0.11.2", environ={})
      Traceback (most recent call last):
      ...
      jdist._src.errors.UnsupportedJaxError: jdist is tested on jax >=0.10,<0.11, ...
    """
    low, high = TESTED
    if low <= minor_release(version) < high:
        return
    tested = f"jax >={low[0]}.{low[1]},<{high[0]}.{high[1]}"
    if environ.get(OVERRIDE) == "1":
        warnings.warn(f"jdist runs on jax {version}, outside the releases it is tested on "
                      f"({tested}), because {OVERRIDE}=1: its analyses of JAX's programs may "
                      "fail or be wrong there.", UserWarning, stacklevel=2)
        return
    raise errors.UnsupportedJaxError(
        f"jdist is tested on {tested}, and this is jax {version}. jdist analyses JAX's "
        "programs (which values are Mirrored, where a partial batch's step is cut), and those "
        "change between JAX releases, so an untested one could give wrong numbers. Install a "
        f"tested release: pip install \"jax{tested[4:]}\" \"jaxlib{tested[4:]}\". To try "
        f"this one anyway, at your own risk, set {OVERRIDE}=1.")
