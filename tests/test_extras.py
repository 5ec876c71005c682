"""Optional extras are checked before a run changes its output directory, with the install command that fits."""

import sys

import pytest

from jaxrl.extras import MissingExtra, check_extras, install_command, source_checkout


def _Config(tensorboard=False, wandb=False):
    from jaxrl.config import Config

    return Config(tensorboard=tensorboard, wandb=wandb)


@pytest.mark.parametrize("key, module", [("wandb", "wandb"), ("tensorboard", "tensorboardX")])
def test_a_missing_extra_names_the_config_key_and_the_install_command(monkeypatch, key, module):
    monkeypatch.setitem(sys.modules, module, None)  # as if it were not installed
    check_extras(_Config())  # off: nothing is needed
    with pytest.raises(MissingExtra) as raised:
        check_extras(_Config(**{key: True}))
    message = str(raised.value)
    assert message.startswith(f"{key}: true needs the {module} package")
    extra = "tensorboard" if key == "tensorboard" else "wandb"
    # this test runs from a source checkout: the command installs the extra into it, from its own path
    assert f"cd {source_checkout()} && pip install -e '.[{extra}]'" in message
    assert raised.value.exit_code == 2 and isinstance(raised.value, ImportError)


def test_install_command_outside_a_checkout_names_the_package_extra(monkeypatch):
    import jaxrl.extras

    assert source_checkout() is not None  # the tests run from the repository
    monkeypatch.setattr(jaxrl.extras, "source_checkout", lambda: None)
    assert install_command("wandb") == "pip install 'jaxrl[wandb]'"


def test_installed_extras_pass():
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboardX")
    check_extras(_Config(tensorboard=True, wandb=True))


def test_a_run_with_a_missing_extra_stops_before_its_output_dir_exists(tmp_path, monkeypatch):
    from jaxrl import loop
    from jaxrl.config import Config

    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as if it were not installed
    with pytest.raises(MissingExtra, match=r"tensorboard: true needs the tensorboardX package"):
        loop.run(Config(output_dir=str(tmp_path / "run"), tensorboard=True))
    assert not (tmp_path / "run").exists()
