"""What each route does: ``OpenAIServing`` checks a request against ``frontend.limits``,
tokenizes it (on the preprocessing pool), submits it to the engine and builds OpenAI's answer,
whole or as server-sent events."""

from __future__ import annotations


import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from functools import partial
from typing import Any

from fastapi.responses import JSONResponse, Response

from corellm.engine.async_llm import AsyncLLM, RequestStream
from corellm.engine.chat import RESERVED_TEMPLATE_KEYS, load_chat_template, render_chat_text
from corellm.engine.output_processor import RequestOutputKind
from corellm.errors import InvalidRequestError
from corellm.serving.fair import FairExecutor
from corellm.outputs import INVALID_REQUEST, SERVER_BUSY, CompletionOutput
from corellm.sampling_params import SamplingParams

from .body import _parse
from .constraints import ConstraintChecks, constraint_fields, structured_outputs
from .errors import APIError, _busy, _invalid
from .lora import LoRAAdapters, runtime_updating_allowed
from .options import OpenAIServerOptions
from .preprocess import TextBound
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                       TokenizeChatRequest, TokenizeCompletionRequest, _SamplingFields)
from .streaming import _gather_finals, _merge, _sse, _sse_data
from .tools import (ChatTools, check_tools, chat_delta, chat_message, finish_reason_of,
                    forced_constraint, log_malformed, parsed, template_messages, tool_choice_of)


# What a chat message costs the template beyond its text, in characters' worth of tokenizing
# (corellm.serving.fair.FairExecutor's unit: about a microsecond).
CHAT_COST_PER_MESSAGE = 16


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, options: OpenAIServerOptions, model_name: str) -> None:
        self.engine = engine
        self.options = options
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.model_info.max_model_len
        self.limits = options.limits
        self.created = int(time.time())
        # Texts too long to fit the context are refused by their length, before tokenizing.
        self.text_bound = TextBound(self.tokenizer, self.max_model_len)
        # Large bodies are parsed, chat templates rendered and texts tokenized here, off the
        # event loop, cheapest job first.
        self._preprocess = FairExecutor("corellm-preprocess")
        # Output constraints: their bounds, and their checks in processes a deadline kills.
        self.constraints = ConstraintChecks(engine, self.limits.constraints, self.off_loop)
        # Tool calling and reasoning: the server's parsers, resolved once (a ConfigError names
        # the key of an unknown one), and the chat template replacing the tokenizer's.
        from corellm.plugins import load_registry
        registry = load_registry(disable=engine.config.plugins.disable)
        self.chat_tools = ChatTools.for_options(options, registry)
        self.chat_template = (load_chat_template(options.chat_template, "frontend.chat_template")
                              if options.chat_template else None)
        # The LoRA adapters served by name (lora.modules, and those loaded at run time).
        self.loras = LoRAAdapters(engine, model_name, options.allowed_lora_paths,
                                  runtime_updating_allowed(options.allow_runtime_lora_updating))

    async def off_loop(self, fn: Callable[..., Any], *args: Any, cost: float) -> Any:
        """Run ``fn`` (tokenizer work) on the preprocessing pool; ``cost``: its estimated work,
        in ``FairExecutor``'s unit (about a microsecond: a character to tokenize)."""
        return await self._preprocess.run(partial(fn, *args), cost)

    def close(self) -> None:
        self._preprocess.shutdown()
        self.constraints.close()

    # ------------------------------------------------------------------ limits
    def check_limits(self, req: _SamplingFields, num_prompts: int, logprobs: int | None,
                     logprobs_field: str) -> None:
        """What a request may ask for (``frontend.limits``): checked before any tokenizer or
        engine work is spent on it."""
        lim = self.limits
        samples = num_prompts * req.n
        if samples > lim.max_samples:
            field = "n" if num_prompts == 1 else "prompt"
            what = f"n={req.n}" if num_prompts == 1 else \
                f"{num_prompts} prompts x n={req.n} = {samples} samples"
            raise APIError(400, f"{field}: {what} exceeds the limit of {lim.max_samples} samples "
                                "per request (frontend.limits.max_samples)", param=field)
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or ())
        if len(stops) > lim.max_stop_strings:
            raise APIError(400, f"stop: {len(stops)} stop strings exceed the limit of "
                                f"{lim.max_stop_strings} (frontend.limits.max_stop_strings)",
                           param="stop")
        for i, stop in enumerate(stops):
            if len(stop) > lim.max_stop_string_chars:
                where = "stop" if isinstance(req.stop, str) else f"stop[{i}]"
                raise APIError(400, f"{where}: {len(stop)} characters exceed the limit of "
                                    f"{lim.max_stop_string_chars} "
                                    "(frontend.limits.max_stop_string_chars)", param="stop")
        if req.stop_token_ids and len(req.stop_token_ids) > lim.max_stop_token_ids:
            raise APIError(400, f"stop_token_ids: {len(req.stop_token_ids)} ids exceed the limit "
                                f"of {lim.max_stop_token_ids} "
                                "(frontend.limits.max_stop_token_ids)", param="stop_token_ids")
        if logprobs and logprobs > 0 and logprobs * samples > lim.max_logprobs_total:
            raise APIError(400, f"{logprobs_field}: {logprobs} alternatives x {samples} samples "
                                f"= {logprobs * samples} per generated position exceed the limit "
                                f"of {lim.max_logprobs_total} "
                                "(frontend.limits.max_logprobs_total)", param=logprobs_field)

    def check_generated_tokens(self, params: list[SamplingParams], field: str,
                               defaulted: bool, logprobs_field: str = "logprobs") -> None:
        self.check_output_entries(params, field, logprobs_field)
        total = sum(p.max_tokens * p.n for p in params)
        limit = self.limits.max_generated_tokens
        if total > limit:
            samples = sum(p.n for p in params)
            per = f"{params[0].max_tokens}" if len({p.max_tokens for p in params}) == 1 \
                else "up to " + str(max(p.max_tokens for p in params))
            why = (f" ({field} was not set: each sample may fill the rest of the context; set "
                   f"{field} or lower n)") if defaulted else ""
            raise APIError(400, f"{field}: {samples} samples x {per} tokens = {total} exceeds the "
                                f"limit of {limit} generated tokens per request "
                                f"(frontend.limits.max_generated_tokens){why}", param=field)

    def check_output_entries(self, params: list[SamplingParams], field: str,
                             logprobs_field: str) -> None:
        """What the response can grow to (``frontend.limits.max_output_entries``): every
        generated position of every sample, each the token and, with logprobs, its own
        log-probability and the alternatives'."""
        lp = params[0].logprobs
        width = 1 if lp is None else 2 + lp
        total = sum(p.max_tokens * p.n for p in params) * width
        limit = self.limits.max_output_entries
        if total > limit:
            samples = sum(p.n for p in params)
            what = "" if lp is None else f" x {width} entries each (the token, its logprob " \
                f"and {lp} alternatives)"
            fields = field if lp is None else f"{field}, n, {logprobs_field}"
            raise APIError(400, f"{fields}: {samples} samples x up to "
                                f"{max(p.max_tokens for p in params)} tokens{what} = {total} "
                                f"exceed the limit of {limit} entries per response "
                                "(frontend.limits.max_output_entries); lower one of them",
                           param=field)

    # ------------------------------------------------------------------ shared pieces
    def check_model(self, name: str | None) -> Any:
        """The LoRA adapter a request's ``model`` names (None: the base model); 404 for a name
        this server does not serve."""
        return self.loras.resolve(name)

    def sampling_params(self, req: Any, max_tokens: int | None, num_prompt_tokens: int,
                        logprobs: int | None, max_tokens_field: str,
                        logprobs_field: str = "logprobs") -> SamplingParams:
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options: only allowed with stream: true",
                           param="stream_options")
        unsupported = {"logit_bias": bool(req.logit_bias),
                       "stream_options.continuous_usage_stats": bool(
                           req.stream_options and req.stream_options.continuous_usage_stats)}
        if isinstance(req, CompletionRequest):
            unsupported |= {"echo": req.echo, "suffix": req.suffix is not None,
                            "best_of": req.best_of is not None and req.best_of != req.n}
        else:
            unsupported |= {"chat_template_kwargs": bool(
                                set(req.chat_template_kwargs or {}) & RESERVED_TEMPLATE_KEYS)}
        for field, used in unsupported.items():
            if used:
                raise APIError(400, f"{field}: not supported by this server", param=field)
        remaining = self.max_model_len - num_prompt_tokens
        if max_tokens is None:
            max_tokens = remaining
        elif isinstance(max_tokens, int) and max_tokens >= 1 and max_tokens > remaining:
            raise APIError(400, f"{max_tokens_field}: this model's maximum context length is "
                                f"{self.max_model_len} tokens; the prompt has "
                                f"{num_prompt_tokens}, so at most {max(remaining, 0)} can be "
                                f"generated, but {max_tokens} were requested",
                           param=max_tokens_field)
        kwargs: dict[str, Any] = dict(
            n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            seed=req.seed, stop=req.stop or [], ignore_eos=req.ignore_eos,
            stop_token_ids=req.stop_token_ids or [], logprobs=logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens, cache_salt=req.cache_salt,
            extra_args=req.vllm_xargs)
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if getattr(req, name) is not None:
                kwargs[name] = getattr(req, name)
        try:
            return SamplingParams(**kwargs, structured_outputs=structured_outputs(req))
        except InvalidRequestError as exc:
            raise _invalid(exc, {"max_tokens": max_tokens_field, "logprobs": logprobs_field,
                                 **constraint_fields(req)}) from None

    def check_text_length(self, text: str, field: str, what: str = "") -> None:
        """Refuse ``text`` when it has more characters than fit in the context, before the
        tokenizer spends time on it (about a second for 1 MiB)."""
        excess = self.text_bound.excess(text)
        if excess:
            raise APIError(400, f"{field}: {what}{excess} characters cannot fit in this "
                                f"model's maximum context length of {self.max_model_len} tokens "
                                f"(model.max_model_len): no token of this tokenizer stands for "
                                f"more than {self.text_bound.per_token} characters", param=field)

    def tokenize_prompt(self, prompt: str | list[int], field: str) -> list[int]:
        if isinstance(prompt, str):
            self.check_text_length(prompt, field)
        try:
            _, ids = self.engine.processor.tokenize(
                prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt})
        except InvalidRequestError as exc:
            raise APIError(400, f"{field}: {exc.message}", param=field) from None
        if len(ids) >= self.max_model_len:
            raise APIError(400, f"{field}: {len(ids)} tokens leaves no room to generate in this "
                                f"model's maximum context length of {self.max_model_len}",
                           param=field)
        return ids

    async def _submit(self, ids: list[int], params: SamplingParams, request_id: str,
                      req: _SamplingFields, kind: RequestOutputKind,
                      group_id: str | None = None, lora: Any = None) -> RequestStream:
        """Validate and queue the request now, so bad input is a 400 even when streaming.
        ``req`` carries the scheduling attributes: priority, user (tenant), session_id;
        ``group_id`` makes the prompts of one call one client request to the scheduler."""
        try:
            # A constraint or processor arguments were checked by ConstraintChecks, in the check
            # processes: not again here, on the event loop.
            checked = params.structured_outputs is not None or params.extra_args is not None
            stream = await self.engine.add_request({"prompt_token_ids": ids}, params, request_id,
                                                   priority=req.priority, user=req.user,
                                                   session_id=req.session_id, group_id=group_id,
                                                   output_kind=kind, params_checked=checked,
                                                   lora_request=lora)
        except InvalidRequestError as exc:
            raise _invalid(exc) from None
        stream.cancel_reason = "client_disconnected"     # what cancels a handler here
        return stream

    def usage(self, num_prompt: int, num_completion: int, num_cached: int) -> dict[str, Any]:
        return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
                "total_tokens": num_prompt + num_completion,
                "prompt_tokens_details": {"cached_tokens": num_cached}}

    @staticmethod
    def check_finish(c: CompletionOutput, renames: dict[str, str] | None = None) -> None:
        """A sample that ended with an error: a 400 naming the field when the request was at
        fault (a constraint the engine could not compile in time), a 503 when others' work kept
        it from being served in time, else a 500 saying why."""
        if c.finish_reason != "error":
            return
        why = c.stop_reason if isinstance(c.stop_reason, str) else None
        if why is not None and why.startswith(INVALID_REQUEST):
            field, _, message = why.removeprefix(INVALID_REQUEST).partition(": ")
            field = (renames or {}).get(field, field)
            raise APIError(400, f"{field}: {message}", param=field,
                           code="constraint_too_complex")
        if why is not None and why.startswith(SERVER_BUSY):
            raise _busy(f"the server is busy: {why.removeprefix(SERVER_BUSY)}")
        raise APIError(500, "the engine failed while generating this request"
                            + (f": {why}" if why else " (see the server log)"),
                       code="engine_error")

    # ------------------------------------------------------------------ /v1/completions
    async def completions(self, req: CompletionRequest) -> Response:
        lora = self.check_model(req.model)
        prompts: list[str | list[int]]
        if isinstance(req.prompt, str) or (req.prompt and isinstance(req.prompt[0], int)):
            prompts = [req.prompt]
        else:
            prompts = list(req.prompt)
        if not prompts:
            raise APIError(400, "prompt: is empty", param="prompt")
        if req.logprobs is not None and req.logprobs < 0:
            raise APIError(400, "logprobs: must be >= 0", param="logprobs")
        self.check_limits(req, len(prompts), req.logprobs, "logprobs")
        constraint_cost = await self.constraints.bounds(req)
        many = len(prompts) > 1
        # One job per prompt, chained: other clients' small jobs run between them.
        token_ids = await self._preprocess.run_all(
            [partial(self.tokenize_prompt, p, f"prompt[{i}]" if many else "prompt")
             for i, p in enumerate(prompts)], [self.text_cost(len(p)) for p in prompts])
        params = [self.sampling_params(req, req.max_tokens, len(ids), req.logprobs, "max_tokens")
                  for ids in token_ids]
        self.check_generated_tokens(params, "max_tokens", defaulted=req.max_tokens is None)
        await self.constraints.check(req, params[0], constraint_cost)
        rid = req.request_id or f"cmpl-{uuid.uuid4().hex}"
        internal = f"{rid}-{uuid.uuid4().hex}" if req.request_id else rid   # never collides
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        gens = []
        try:
            for i, (ids, p) in enumerate(zip(token_ids, params)):
                gens.append(await self._submit(ids, p, f"{internal}-{i}", req, kind,
                                               group_id=internal if many else None, lora=lora))
        except BaseException:
            for g in gens:
                g.close()
            raise
        if req.stream:
            return _sse(self._stream_completion(req, rid, gens, token_ids), gens)
        finals = await _gather_finals(gens)
        choices, num_completion, num_cached = [], 0, 0
        for i, out in enumerate(finals):
            num_cached += out.num_cached_tokens
            for c in out.outputs:
                self.check_finish(c, constraint_fields(req))
                num_completion += len(c.token_ids)
                choices.append({"index": i * req.n + c.index, "text": c.text,
                                "logprobs": None if req.logprobs is None
                                else self._completion_logprobs(c, req.logprobs),
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": int(time.time()),
            "model": self.model_name, "choices": choices,
            "usage": self.usage(sum(map(len, token_ids)), num_completion, num_cached)})

    def _completion_logprobs(self, c: CompletionOutput, k: int, offset: int = 0,
                             ) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        pos = offset
        for tid, entry in zip(c.token_ids, c.logprobs or []):
            chosen = entry[tid]
            text = chosen.decoded_token or ""
            tokens.append(text)
            token_lps.append(chosen.logprob)
            # legacy format: the top alternatives and the sampled token, text -> logprob
            top = {lp.decoded_token or "": lp.logprob for lp in _top_k(entry, tid, k)}
            top.setdefault(text, chosen.logprob)
            tops.append(top)
            offsets.append(pos)
            pos += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    async def _stream_completion(self, req: CompletionRequest, rid: str,
                                 gens: list[RequestStream],
                                 token_ids: list[list[int]]) -> AsyncIterator[str]:
        created = int(time.time())
        num_completion, num_cached = 0, 0
        offsets: dict[int, int] = {}
        async for i, out in _merge(gens):
            if out.finished:
                num_cached += out.num_cached_tokens
            for c in out.outputs:
                self.check_finish(c, constraint_fields(req))
                index = i * req.n + c.index
                num_completion += len(c.token_ids)
                logprobs = None
                if req.logprobs is not None:
                    logprobs = self._completion_logprobs(c, req.logprobs, offsets.get(index, 0))
                    offsets[index] = offsets.get(index, 0) + sum(map(len, logprobs["tokens"]))
                yield _sse_data({
                    "id": rid, "object": "text_completion", "created": created,
                    "model": self.model_name,
                    "choices": [{"index": index, "text": c.text, "logprobs": logprobs,
                                 "finish_reason": c.finish_reason,
                                 "stop_reason": c.stop_reason}]})
        if req.stream_options and req.stream_options.include_usage:
            yield _sse_data({"id": rid, "object": "text_completion", "created": created,
                             "model": self.model_name, "choices": [],
                             "usage": self.usage(sum(map(len, token_ids)), num_completion,
                                                 num_cached)})

    # ------------------------------------------------------------------ /v1/chat/completions
    def render_chat(self, req: ChatCompletionRequest, continue_final_message: bool = False,
                    tools: list[dict] | None = None) -> list[int]:
        """``tools``: the request's, checked (``check_tools``); checked here when not given."""
        text = render_chat_text(self.tokenizer, template_messages(req),
                                add_generation_prompt=req.add_generation_prompt,
                                continue_final_message=continue_final_message,
                                chat_template=self.chat_template,
                                chat_template_kwargs=req.chat_template_kwargs,
                                tools=check_tools(req.tools) if tools is None else tools)
        self.check_text_length(text, "messages", "the chat template's output: ")
        # The template writes the special tokens (BOS) itself.
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenize_prompt(ids, "messages")

    def text_cost(self, chars: int) -> int:
        """About what tokenizing a text of ``chars`` characters costs (a microsecond a
        character): no more than the longest text that can fit, longer ones are refused."""
        bound = self.text_bound.max_chars
        return chars if bound is None else min(chars, bound)

    def chat_cost(self, messages: Sequence[Any]) -> int:
        """About what rendering and tokenizing ``messages`` costs: their text, and for each
        message the template's work on it, in the units of ``text_cost`` (a character), so
        a request of many short messages is not costed as a cheap one."""
        chars = sum(len(m.content) if isinstance(m.content, str)
                    else sum(len(p.text) for p in m.content or ()) for m in messages)
        return self.text_cost(chars) + CHAT_COST_PER_MESSAGE * len(messages)

    async def chat(self, req: ChatCompletionRequest) -> Response:
        lora = self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs: true", param="top_logprobs")
        # Checking schemas costs time with their size: off the event loop.
        tools = await self.off_loop(check_tools, req.tools,
                                    cost=self.text_cost(_tools_size(req.tools)))
        choice, tool_name = tool_choice_of(req, tools)
        self.chat_tools.check_auto(choice, tools)
        explicit = req.structured_outputs is not None     # vLLM's field: the whole output
        forced = forced_constraint(req, choice, tool_name, tools)
        if forced is not None:           # generation constrained to the calls' JSON
            req = req.model_copy(update={"structured_outputs": forced})
        if self.chat_tools.needs_special_tokens(choice):
            req = req.model_copy(update={"skip_special_tokens": False})
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        self.check_limits(req, 1, logprobs, "top_logprobs")
        constraint_cost = await self.constraints.bounds(req)
        ids = await self.off_loop(self.render_chat, req, False, tools,
                                  cost=self.chat_cost(req.messages))
        max_tokens, field = req.max_completion_tokens, "max_completion_tokens"
        if max_tokens is None:
            max_tokens, field = req.max_tokens, "max_tokens"
        params = self.sampling_params(req, max_tokens, len(ids), logprobs, field,
                                      "top_logprobs")
        self.check_generated_tokens([params], field, defaulted=max_tokens is None,
                                    logprobs_field="top_logprobs")
        if params.structured_outputs is not None and not explicit:
            # With a reasoning parser, response_format and a forced tool call constrain the
            # answer only (vLLM's structured_outputs constrains the whole output, as given).
            params.structured_outputs.start_after = self.chat_tools.answer_marker(
                self.tokenizer, ids)
        await self.constraints.check(req, params, constraint_cost)
        rid = req.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        internal = f"{rid}-{uuid.uuid4().hex}" if req.request_id else rid
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        gen = await self._submit(ids, params, internal, req, kind, lora=lora)

        fmt = (req.response_format or {}).get("type")
        json_content = forced is None and fmt in ("json_object", "json_schema")

        def parser() -> Any:
            return parsed(lambda _: self.chat_tools.output_parser(choice, tool_name, tools,
                                                                  json_content), "")
        if req.stream:
            return _sse(self._stream_chat(req, rid, gen, len(ids), parser, choice), [gen])
        out, = await _gather_finals([gen])
        choices, num_completion = [], 0
        for c in out.outputs:
            self.check_finish(c, constraint_fields(req))
            num_completion += len(c.token_ids)
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            finish_reason = c.finish_reason
            p = parser()
            if p is not None:
                _, parts = parsed(p.finish, c.text)
                log_malformed(rid, c.index, p)
                message = chat_message(parts)
                finish_reason = finish_reason_of(finish_reason, parts, choice)
            choices.append({"index": c.index, "message": message,
                            "logprobs": self._chat_logprobs(c, req) if req.logprobs else None,
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name, "choices": choices,
            "usage": self.usage(len(ids), num_completion, out.num_cached_tokens)})

    def _chat_logprobs(self, c: CompletionOutput, req: ChatCompletionRequest) -> dict[str, Any]:
        k = req.top_logprobs or 0
        content = []
        for tid, entry in zip(c.token_ids, c.logprobs or []):
            chosen = entry[tid]
            content.append({**_token_logprob(chosen), "top_logprobs": [
                _token_logprob(lp) for lp in _top_k(entry, tid, k)]})
        return {"content": content}

    async def _stream_chat(self, req: ChatCompletionRequest, rid: str,
                           gen: RequestStream, num_prompt: int, parser: Callable[[], Any],
                           choice: str = "none") -> AsyncIterator[str]:
        created = int(time.time())
        base = {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": self.model_name}
        for j in range(req.n):
            yield _sse_data({**base, "choices": [{"index": j, "delta": {"role": "assistant",
                                                                          "content": ""},
                                                  "logprobs": None, "finish_reason": None}]})
        num_completion, num_cached = 0, 0
        # Each choice's parser reads its whole text so far (the deltas are what is new).
        parsers: dict[int, Any] = {}
        texts: dict[int, str] = {}
        async for out in gen:
            if out.finished:
                num_cached = out.num_cached_tokens
            for c in out.outputs:
                self.check_finish(c, constraint_fields(req))
                num_completion += len(c.token_ids)
                if c.index not in parsers:
                    parsers[c.index] = parser()
                p = parsers[c.index]
                finish_reason = c.finish_reason
                if p is None:
                    delta: dict[str, Any] = {"content": c.text} if c.text else {}
                else:
                    texts[c.index] = text = texts.get(c.index, "") + c.text
                    if c.finish_reason is None:
                        d = parsed(p.delta, text)
                    else:
                        d, parts = parsed(p.finish, text)
                        log_malformed(rid, c.index, p)
                        finish_reason = finish_reason_of(finish_reason, parts, choice)
                    delta = chat_delta(d)
                    if not delta and finish_reason is None and not req.logprobs:
                        continue             # nothing new to say yet (a tag held back)
                yield _sse_data({**base, "choices": [{
                    "index": c.index, "delta": delta,
                    "logprobs": self._chat_logprobs(c, req) if req.logprobs else None,
                    "finish_reason": finish_reason, "stop_reason": c.stop_reason}]})
        if req.stream_options and req.stream_options.include_usage:
            yield _sse_data({**base, "choices": [],
                             "usage": self.usage(num_prompt, num_completion, num_cached)})

    # ------------------------------------------------------------------ /tokenize, /detokenize
    async def tokenize(self, data: dict[str, Any]) -> Response:
        """vLLM's ``POST /tokenize``: a ``prompt`` as /v1/completions tokenizes it, or
        ``messages`` as /v1/chat/completions renders and tokenizes them."""
        req: TokenizeCompletionRequest | TokenizeChatRequest
        if "messages" in data:
            req = _parse(TokenizeChatRequest, data)
            self.check_model(req.model)
            ids = await self.off_loop(lambda: self.render_chat(
                self._chat_for_tokenize(req), continue_final_message=req.continue_final_message),
                cost=self.chat_cost(req.messages))
        elif "prompt" in data:
            req = _parse(TokenizeCompletionRequest, data)
            self.check_model(req.model)
            # Not bounded by the context: counting a long text's tokens is what this is for.
            ids = await self.off_loop(lambda: self.tokenizer.encode(
                req.prompt, add_special_tokens=req.add_special_tokens), cost=len(req.prompt))
        else:
            raise APIError(400, "prompt: field required (or messages, to tokenize a chat)",
                           param="prompt")
        return JSONResponse({
            "count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
            "token_strs": self.tokenizer.convert_ids_to_tokens(ids)
            if req.return_token_strs else None})

    def _chat_for_tokenize(self, req: TokenizeChatRequest) -> ChatCompletionRequest:
        """The chat request whose rendering (``render_chat``) /tokenize returns."""
        if req.continue_final_message and req.add_generation_prompt:
            raise APIError(400, "continue_final_message: cannot be combined with "
                                "add_generation_prompt: true", param="continue_final_message")
        if req.add_special_tokens:
            raise APIError(400, "add_special_tokens: only false with messages (the chat template "
                                "writes the special tokens)", param="add_special_tokens")
        kwargs = dict(req.chat_template_kwargs or {})
        if set(kwargs) & RESERVED_TEMPLATE_KEYS:
            raise APIError(400, "chat_template_kwargs: not supported by this server",
                           param="chat_template_kwargs")
        return ChatCompletionRequest(messages=req.messages, tools=req.tools,
                                     add_generation_prompt=req.add_generation_prompt,
                                     chat_template_kwargs=kwargs or None)

    async def detokenize(self, req: DetokenizeRequest) -> Response:
        """vLLM's ``POST /detokenize``: ``tokens`` back to text (special tokens kept)."""
        self.check_model(req.model)
        vocab = self.engine.model_info.vocab_size
        for i, t in enumerate(req.tokens):
            if not 0 <= t < vocab:
                raise APIError(400, f"tokens[{i}]: token id {t} is outside the vocabulary "
                                    f"[0, {vocab})", param="tokens")
        return JSONResponse({"prompt": await self.off_loop(self.tokenizer.decode, req.tokens,
                                                           cost=len(req.tokens))})


def _tools_size(tools: Any) -> int:
    """About how many characters the tools are (their checks' cost)."""
    import json
    try:
        return len(json.dumps(tools)) if tools else 0
    except (TypeError, ValueError, RecursionError):
        return 1 << 20


def _top_k(entry: dict[int, Any], sampled: int, k: int) -> list[Any]:
    """The top-k alternatives of one position, best first (the sampled token's own entry is
    among them only if it ranks in the top k)."""
    ranked = sorted(((lp.rank, t, lp) for t, lp in entry.items() if lp.rank is not None),
                    key=lambda x: x[0])
    seen, result = set(), []
    for rank, t, lp in ranked:
        if t in seen or (t == sampled and rank > k):
            continue
        seen.add(t)
        result.append(lp)
    return result[:k]


def _token_logprob(lp: Any) -> dict[str, Any]:
    text = lp.decoded_token or ""
    return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}
