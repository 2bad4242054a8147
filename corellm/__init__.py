"""corellm: a pluggable LLM inference engine.

    from corellm import LLM, SamplingParams
    llm = LLM({"model": {"path": "./my-checkpoint"}})
    print(llm.generate("Hello", SamplingParams(max_tokens=16))[0].outputs[0].text)
"""

from corellm import _imports
from corellm.hookspecs import hookimpl
from corellm.sampling_params import SamplingParams

_imports.install()      # the modules' paths before 0.6 (CorellmDeprecationWarning)

__version__ = "0.6.8"

__all__ = ["LLM", "AsyncLLM", "EngineConfig", "SamplingParams", "RequestOutput",
           "CompletionOutput", "LoRARequest", "hookimpl", "load_config", "__version__"]


def __getattr__(name: str):
    # The engine pulls in torch; plugin modules import `corellm.hookimpl` and must stay light.
    if name == "LLM":
        from corellm.engine.llm import LLM
        return LLM
    if name == "AsyncLLM":
        from corellm.engine.async_llm import AsyncLLM
        return AsyncLLM
    if name in ("EngineConfig", "load_config"):
        from corellm.config import compose
        return getattr(compose, name)
    if name == "LoRARequest":
        from corellm.lora.request import LoRARequest
        return LoRARequest
    if name in ("RequestOutput", "CompletionOutput"):
        from corellm import outputs
        return getattr(outputs, name)
    raise AttributeError(f"module 'corellm' has no attribute {name!r}")
