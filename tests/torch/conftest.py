"""The torch tests' shared job: scripts registered with
`tests.utils.register_torch_part` run in the processes of one 2-rank job
(`tests.utils.run_torch_parts`), the first time a test marked
``torch_part(name)`` needs it."""

import pytest

from tests.utils import TorchParts, run_torch_parts


@pytest.fixture(scope="session")
def torch_parts(request, tmp_path_factory):
    """The shared job's `TorchParts`: every part a selected test marks."""
    names = []
    for item in request.session.items:
        marker = item.get_closest_marker("torch_part")
        if marker is not None and marker.args[0] not in names:
            names.append(marker.args[0])
    directory = tmp_path_factory.mktemp("torch_parts")
    proc, seconds = run_torch_parts(directory, names)
    print(f"shared torch job ({', '.join(names)}): {seconds:.1f} s")
    return TorchParts(directory, proc, seconds)
