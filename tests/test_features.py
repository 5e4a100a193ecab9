"""The engine's feature interface (meshtron/train/features.py): the compression state keeps the
checkpoint key saved checkpoints use, and only Stateful features are checkpointed. The features
acting in real steps are covered by the training tests (MoE bias: test_moe_train.py; DiLoCo and
compression: test_checkpoint_matrix.py, test_compress_dist.py)."""

from meshtron.compress.diloco import DiLoCo
from meshtron.compress.runtime import GradCompression
from meshtron.train.features import EngineFeature, Fp8Scales, MoEBias, stateful_features


def test_compression_states_are_features_under_the_saved_key():
    for cls in (DiLoCo, GradCompression):
        assert cls.name == "compress"  # the key in every checkpoint written so far
        for method in ("after_optimizer_step", "release", "state_dict", "load_state_dict"):
            assert callable(getattr(cls, method, None)), (cls, method)


def test_only_stateful_features_are_checkpointed():
    class Counter:
        name = "counter"

        def __init__(self):
            self.steps = 0

        def after_optimizer_step(self):
            self.steps += 1

        def release(self):
            pass

        def state_dict(self):
            return {"steps": self.steps}

        def load_state_dict(self, state):
            self.steps = state["steps"]

    counter, fp8 = Counter(), Fp8Scales(pm=None)
    moe = MoEBias(parts=[], data_group=lambda: None)
    for feature in (counter, fp8, moe):
        assert isinstance(feature, EngineFeature)
    assert stateful_features([fp8, moe, counter]) == {"counter": counter}
    assert stateful_features([fp8, moe]) == {}
