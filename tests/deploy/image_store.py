"""A private container storage for one test module: buildah and podman with ``--root``/``--runroot``
under a temporary folder, so parallel runs and the machine's own images never collide, and every
container, image and mount in it gone at ``close()``.

    store = ImageStore(tmp_dir)
    store.buildah("inspect", "--type", "image", tag)      # CompletedProcess; raises on a non-zero exit
    store.close()
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

# command: Debian package (unshare and ip: the offline runs)
TOOLS = {"mmdebstrap": "mmdebstrap", "buildah": "buildah", "podman": "podman", "unshare": "util-linux",
         "ip": "iproute2"}


def missing_tools() -> list[str]:
    return [f"{command} (Debian's {package})" for command, package in TOOLS.items() if shutil.which(command) is None]


class ImageStore:
    def __init__(self, folder: Path):
        self.folder = folder
        self.root = folder / "root"
        # containers/storage refuses a runroot longer than 50 characters, which a pytest-xdist worker's
        # temporary folder is: the runroot gets a short folder of its own
        self.runroot = Path(tempfile.mkdtemp(prefix="epd-run-"))

    @property
    def flags(self) -> list[str]:
        return ["--root", str(self.root), "--runroot", str(self.runroot)]

    def buildah(self, *args: str, timeout_s: float = 120.0, check: bool = True,
                offline: bool = False) -> subprocess.CompletedProcess:
        """``buildah --root .. --runroot .. *args``; AssertionError (with its output) on a non-zero exit
        when ``check``. ``offline``: in a new network namespace that has loopback alone (``unshare
        --net``, then ``ip link set lo up``): what runs there reaches nothing off this machine."""
        command = ["buildah", *self.flags, *args]
        if offline:
            command = ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        if check and done.returncode != 0:
            raise AssertionError(f"buildah {' '.join(args)} exited {done.returncode}:\n{done.stdout}{done.stderr}")
        return done

    def close(self) -> None:
        """Remove the containers and images, unmount what the storage left mounted (its overlay
        folder stays bind-mounted after a build), then the folder."""
        if self.root.exists():
            self.buildah("rm", "--all", check=False)
            self.buildah("rmi", "--all", "--force", check=False)
        for mount in reversed(self._mounts()):
            subprocess.run(["umount", "--lazy", mount], check=False)
        shutil.rmtree(self.folder, ignore_errors=True)
        shutil.rmtree(self.runroot, ignore_errors=True)

    def _mounts(self) -> list[str]:
        """Mount points under the folder or the runroot, parents first (/proc/self/mountinfo's fifth field)."""
        inside = tuple(str(f.resolve()) + "/" for f in (self.folder, self.runroot))
        points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
        return sorted(p for p in points if p.startswith(inside))
