"""Structured output: JSON schemas and ``response_format`` compiled into the engine's ``Guide``
(``stages.engine.guide``), over llguidance. ``GuideCompiler`` is built beside each prompt builder
(``stages.loading``); what it compiles rides in ``SamplingParams.guide``."""

from stages.guided.compiler import GuideCompiler

__all__ = ["GuideCompiler"]
