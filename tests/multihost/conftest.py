"""The multi-host rig's fixtures (``tests/multihost/rig.py``).

``rig_ready``  (session, autouse) fails every test here, saying why, when network namespaces cannot
    be made (not root, no ``ip``/``nft``/``ss``): a skipped rig would hide every regression it exists
    to catch. It also deletes namespaces left by runs that died (``rig.sweep``).
``make_rig(family=4) -> Rig``  (module) a rig that is up; torn down when the module's tests are done.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.multihost.rig import Rig, RigUnavailable, require_namespaces, sweep


@pytest.fixture(scope="session", autouse=True)
def rig_ready() -> None:
    try:
        require_namespaces()
    except RigUnavailable as exc:
        pytest.fail(f"the multi-host rig cannot run here: {exc}", pytrace=False)
    sweep()


@pytest.fixture(scope="module")
def make_rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Rig]]:
    rigs: list[Rig] = []

    def make(family: int = 4) -> Rig:
        rig = Rig(tmp_path_factory.mktemp(f"rig{family}-logs"), family=family)
        rigs.append(rig)
        return rig.up()

    try:
        yield make
    finally:
        for rig in rigs:
            rig.down()
