"""One registry for families, backends and plain implementations (quantstudy.registry): a name taken
twice and a protocol member missing are errors that name the module, as it loads."""

from __future__ import annotations

import pytest

from quantstudy import backends, families, plain, registry
from quantstudy.families.base import Family
from quantstudy.families.fnet import FNet


def test_a_second_family_of_a_taken_name_is_refused_and_the_first_kept():
    class AnotherFNet(FNet):
        pass

    with pytest.raises(registry.RegistryError, match=r"two family implementations are named 'fnet': "
                       r"quantstudy\.families\.fnet\.FNet and .*AnotherFNet"):
        families.register("fnet")(AnotherFNet)
    assert type(families.get("fnet")) is FNet


def test_a_family_that_lacks_a_member_of_the_contract_is_named_and_not_registered():
    members = {m: getattr(FNet, m) for m in registry.protocol_members(Family) if m not in ("name", "kernel_group")}
    incomplete = type("NoKernelGroups", (), {**members, "__module__": __name__})
    with pytest.raises(registry.RegistryError, match=rf"{__name__}\.NoKernelGroups does not implement the family "
                       r"protocol \(quantstudy\.families\.base\.Family\): it lacks kernel_group$"):
        families.register("no_kernel_group")(incomplete)
    assert "no_kernel_group" not in families.names()


def test_a_backend_that_lacks_profile_is_named():
    torch_backend = backends.get("torch")

    class NoProfile:
        name, builds_from, build_times_kernels = "no_profile", "module", False
        builder_options, build, open = torch_backend.builder_options, torch_backend.build, torch_backend.open

    with pytest.raises(registry.RegistryError, match=r"NoProfile does not implement the backend protocol .*: it lacks profile"):
        backends.register(NoProfile)
    with pytest.raises(KeyError, match="unknown backend 'no_profile'"):
        backends.get("no_profile")


def test_a_plain_module_without_its_layer_prefix_is_named_as_it_loads(tmp_path, monkeypatch):
    """A registry of modules (plain implementations) checks the module itself: here, a package of two."""
    package = tmp_path / "plain_stand_in"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "good.py").write_text("LAYER_PREFIX = ''\nGRAPHS = ('main',)\nEXTRA_TRANSFORMS = set()\n"
                                     "def model(checkpoint, setting, variant, device, graph):\n    return None\n")
    (package / "broken.py").write_text("GRAPHS = ('main',)\nEXTRA_TRANSFORMS = set()\n"
                                       "def model(checkpoint, setting, variant, device, graph):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    stand_in = registry.Registry("plain implementation", "plain_stand_in", plain.Implementation, modules=True)
    assert stand_in.get("good").GRAPHS == ("main",)
    with pytest.raises(registry.RegistryError, match=r"^plain_stand_in\.broken does not implement the plain "
                       r"implementation protocol .*: it lacks LAYER_PREFIX$"):
        stand_in.get("broken")


def test_each_registry_holds_what_the_package_declares():
    assert families.names() == ["deberta_v2", "deformable_detr", "fnet", "gpt_neo", "timm_xcit"]
    assert backends.names() == ["onnxruntime", "tensorrt", "torch"]
    assert plain.names() == families.names()
    with pytest.raises(KeyError, match=r"unknown family 'fnot'; known: deberta_v2, "):
        families.get("fnot")
