"""The trainer's flags are made from TrainConfig: one per field, with its type, default and docstring."""

import dataclasses

import pytest

from eaglet.services.trainer import main as trainer_main
from eaglet.services.trainer.config import TrainConfig

FIELDS = [f.name for f in dataclasses.fields(TrainConfig)]


def parse(argv: list[str]):
    return trainer_main.build_parser().parse_args(argv)


def flag_actions() -> dict[str, object]:
    """The parser's actions by long option (``--ttt-steps``), as ``--help`` shows them."""
    parser = trainer_main.build_parser()
    return {option: action for action in parser._actions for option in action.option_strings}


@pytest.mark.parametrize("name", FIELDS)
def test_every_field_has_a_flag_with_its_default_and_help(name):
    action = flag_actions()["--" + name.replace("_", "-")]
    assert action.dest == name
    assert action.default == getattr(TrainConfig(), name)
    assert action.help and action.help.strip()


def test_defaults_give_the_default_config():
    args = parse(["--run", "r"])
    assert trainer_main.config_from_args(TrainConfig, args) == TrainConfig()


def test_flags_set_the_fields_with_their_types():
    argv = ["--run", "r", "--tokens-per-batch", "2048", "--loader-workers", "0", "--lr", "3e-4",
            "--attention", "math", "--no-init-from-target", "--step-weight", "0.5"]  # fmt: skip
    cfg = trainer_main.config_from_args(TrainConfig, parse(argv))
    assert cfg == TrainConfig(tokens_per_batch=2048, loader_workers=0, lr=3e-4, attention="math",
                              init_from_target=False, step_weight=0.5)  # fmt: skip


def test_a_choice_outside_the_literal_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse(["--run", "r", "--oov-mask", "sometimes"])
    assert "--oov-mask" in capsys.readouterr().err


def test_bad_values_name_the_field():
    args = parse(["--run", "r", "--tokens-per-batch", "0"])
    with pytest.raises(ValueError, match="tokens_per_batch"):
        trainer_main.config_from_args(TrainConfig, args)


def test_every_field_is_documented():
    assert set(trainer_main.field_docs(TrainConfig)) == set(FIELDS)
