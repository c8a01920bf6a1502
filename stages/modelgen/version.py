"""What ``make_model`` writes, by version: bump ``GENERATOR_VERSION`` when the files change for a
model already made, so that a checkpoint cached by name (``stages.launch.models.ensure_model``: the
default model of ``stage up``, ``stage demo`` and the benchmarks) is remade when its version differs.

1: (no version file) the first checkpoints. 2: the ChatML templates render tools in Qwen2.5's format.
3: the Qwen families get video_preprocessor_config.json and templates that render video parts.
"""

GENERATOR_VERSION = 3
VERSION_FILE = "modelgen_version"  # in each checkpoint: GENERATOR_VERSION, as text
