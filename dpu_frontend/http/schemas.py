"""Request models: what the handlers validate with and what /openapi.json describes.

Strict pydantic models (no "5" for 5, no true for 1), unknown fields
refused. Parameters the GPU side cannot honour are named in ``UNSUPPORTED``
and refused with a 400 that says why, never silently ignored.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.config import JsonDict, JsonValue

from dpu_frontend.errors import ModelNotFound, RequestError
from dpu_frontend.ring.layout import MAX_TOP_LOGPROBS
from dpu_frontend.ring.records import MAX_STOP_TOKEN_IDS, U32_MAX
from dpu_frontend.text.chat_template import MAX_NESTING, nesting_exceeds, reserved_kwarg
from dpu_frontend.text.constraints import ConstraintError, ConstraintSpec


def _integral(value: Any) -> Any:
    """3.0 is an integer in JSON Schema (any number with a zero fraction), as the served
    /openapi.json says: it validates as 3. 3.5, "3" and true stay refused."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


#: Integer fields are strict, but a JSON number with a zero fraction (3.0) is one. The
#: validator goes after the bounds: pydantic then writes them as minimum/maximum.
INTEGRAL = BeforeValidator(_integral)
#: Marks token ids in the schema: /openapi.json bounds them by the served vocabulary.
TOKEN_ID = "x-token-id"
TokenId = Annotated[int, Field(ge=0, le=U32_MAX, json_schema_extra={TOKEN_ID: True}), INTEGRAL]
NonEmpty = Annotated[str, Field(min_length=1)]
TokenCount = Annotated[int, Field(ge=1, le=U32_MAX), INTEGRAL]
Seed = Annotated[int, Field(ge=-(2**63), lt=2**64), INTEGRAL]  # OpenAI's int64, or a u64
MAX_STOP_STRINGS = 16
MAX_N = 16

#: Parameters clients send that the ring protocol does not carry, with the
#: reason given back. A value that asks for nothing (``_OFF``) is accepted.
UNSUPPORTED = {
    "echo": "echo is not supported",
    "best_of": "best_of is not supported; use n",
    "logit_bias": "logit_bias is not carried by the ring protocol",
    "suffix": "suffix (insertion) is not supported",
    "functions": "the deprecated functions parameter is not supported; use tools",
    "function_call": "the deprecated function_call parameter is not supported; use "
                     "tool_choice",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "reasoning effort is not supported",
    "web_search_options": "web search is not supported",
}
_OFF: dict[str, tuple[Any, ...]] = {
    "functions": ([],),
    "modalities": (["text"],), "reasoning_effort": (),
}


def _stop_list(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


#: What the validators refuse beyond each field's type, said in /openapi.json as well:
#: stream_options only with stream: true ...
_STREAMING: JsonDict = {
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}}}
#: ... top_logprobs above 0 only with logprobs: true ...
_LOGPROBS: JsonDict = {
    "if": {"required": ["top_logprobs"],
           "properties": {"top_logprobs": {"type": "integer", "minimum": 1}}},
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}}
#: ... at most one constraint (structured output) ...
_SET: dict[str, JsonValue] = {
    "response_format": {"type": "object", "required": ["type"],
                        "properties": {"type": {"enum": ["json_object", "json_schema"]}}},
    "guided_json": {"type": ["object", "string"]},
    "guided_regex": {"type": "string"},
    "guided_choice": {"type": "array"}}
_UNSET: dict[str, JsonValue] = {
    "response_format": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
        "type": {"const": "text"}}}]},
    "guided_json": {"type": "null"}, "guided_regex": {"type": "null"},
    "guided_choice": {"type": "null"}}


def _before(name: str) -> JsonDict:
    """If ``name`` constrains, none of the fields after it does: pairwise exclusion in
    three rules, where a rule a field would be one too many for the generator."""
    names = list(_SET)
    unset: JsonDict = {other: _UNSET[other] for other in names[names.index(name) + 1:]}
    return {"if": {"required": [name], "properties": {name: _SET[name]}},
            "then": {"properties": unset}}


_CONSTRAINTS: list[JsonValue] = [_before(name) for name in list(_SET)[:-1]]
#: ... and not both add_generation_prompt and continue_final_message set to true. Each
#: rule is an if/then of plain types: Hypothesis (schemathesis) cannot generate from a
#: "not" of several properties beside them.
_EXCLUSIVE: JsonDict = {
    "if": {"required": ["add_generation_prompt"],
           "properties": {"add_generation_prompt": {"const": True}}},
    "then": {"properties": {"continue_final_message": {"const": False}}}}


#: OpenAI's rule for a function's name (and a response format's).
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
MAX_CHOICES = 256


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: the schema the answer must satisfy."""

    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    #: Always enforced: the GPU side decodes within the schema whatever this says.
    strict: bool | None = None


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat,
                           Field(discriminator="type")]


class SamplingFields(_Strict):
    """Fields both generation endpoints share; all go to the GPU side or the stop matcher."""

    model_config = ConfigDict(json_schema_extra={"allOf": [_STREAMING, *_CONSTRAINTS]})

    model: str
    max_tokens: TokenCount | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: Annotated[int, Field(ge=-1, le=2**31 - 1), INTEGRAL] = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: Seed | None = None
    stop: NonEmpty | Annotated[list[NonEmpty], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    n: Annotated[int, Field(ge=1, le=MAX_N), INTEGRAL] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = Field(None, description=(
        "json_object or json_schema: the answer is decoded within it on the GPU (an "
        "automaton compiled on the DPU masks each step's draw); text: unconstrained"))
    guided_json: dict[str, Any] | str | None = Field(None, description=(
        "vLLM's: a JSON schema (or its text) the answer satisfies"))
    guided_regex: NonEmpty | None = Field(None, json_schema_extra={"format": "regex"},
                                          description=(
        "vLLM's: a regular expression the whole answer matches (^ and $ at its ends are "
        "implied)"))
    guided_choice: Annotated[list[NonEmpty], Field(min_length=1, max_length=MAX_CHOICES)] | None = (
        Field(None, description="vLLM's: the answer is one of these strings"))

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = _stop_list(stop)
        if len(stops) > MAX_STOP_STRINGS or not all(stops):
            raise ValueError(f"stop must be at most {MAX_STOP_STRINGS} non-empty strings")
        return stop

    @field_validator("seed")
    @classmethod
    def _seed_as_u64(cls, seed: int | None) -> int | None:
        """The ring carries a u64: a negative seed is its two's complement (-1 is
        2**64 - 1), mapped here, once, so that every layer below sees a u64."""
        return None if seed is None else seed % 2**64

    @field_validator("stream_options")
    @classmethod
    def _check_stream_options(cls, options: StreamOptions | None,
                              info: ValidationInfo) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream=true")
        return options

    @property
    def stop_strings(self) -> list[str]:
        return _stop_list(self.stop)

    @property
    def top_logprobs_wanted(self) -> int | None:
        """Alternatives per token the answer lists; None: no log probabilities."""
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def constrained(self) -> bool:
        """Whether the answer is decoded within a constraint."""
        return (isinstance(self.response_format, JsonObjectFormat | JsonSchemaResponseFormat)
                or any(f is not None for f in (self.guided_json, self.guided_regex,
                                                self.guided_choice)))

    def constraint(self) -> ConstraintSpec | None:
        """The structured output asked for, if any: at most one of response_format
        (json_object, json_schema), guided_json, guided_regex and guided_choice. A
        schema the compiler would not enforce is a 400 naming its field. With one,
        the answer ends where the constraint's text does, whatever ignore_eos says."""
        specs: list[ConstraintSpec] = []
        try:
            rf = self.response_format
            if isinstance(rf, JsonObjectFormat):
                specs.append(ConstraintSpec.json_object())
            elif isinstance(rf, JsonSchemaResponseFormat):
                specs.append(ConstraintSpec.json_schema(rf.json_schema.schema_))
            if self.guided_json is not None:
                schema = self.guided_json
                if isinstance(schema, str):
                    try:
                        schema = json.loads(schema)
                    except ValueError as exc:
                        raise ConstraintError(f"guided_json is not JSON: {exc}",
                                              "guided_json") from exc
                specs.append(ConstraintSpec.json_schema(schema, "guided_json"))
            if self.guided_regex is not None:
                specs.append(ConstraintSpec.regex(self.guided_regex))
            if self.guided_choice is not None:
                specs.append(ConstraintSpec.choice(self.guided_choice))
        except ConstraintError as exc:
            raise RequestError(str(exc), param=exc.param) from exc
        if len(specs) > 1:
            raise RequestError("one constraint at a time: response_format, guided_json, "
                               "guided_regex or guided_choice", param=specs[1].param)
        return specs[0] if specs else None


#: Alternatives per token the ring carries (OpenAI's completions allow 5 as well).
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), INTEGRAL]


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    logprobs: TopLogprobs | None = Field(None, description=(
        "log probabilities of the generated tokens, with this many most likely "
        "alternatives each"))

    @property
    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    # Non-empty all the way down: an empty prompt encodes to no token at all.
    prompt: (NonEmpty | Annotated[list[NonEmpty], Field(min_length=1)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message. Extra keys (``tool_call_id``, ...) reach the template as they are."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: ``content`` always a string (templates
        read it unguarded; the schema lets it be absent or null, which is "")."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        else:
            message["content"] = self.content or ""
        return message


def _check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    if (key := reserved_kwarg(kwargs)) is not None:
        raise ValueError(f"may not set '{key}': the chat template gets it from the request")
    return kwargs


class _ChatRendering(_Strict):
    """How the messages become a prompt: the fields both chat endpoints share."""

    model_config = ConfigDict(json_schema_extra={"allOf": [_EXCLUSIVE]})
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = Field(True, description=(
        "end the prompt with the assistant's turn header; false by default when "
        "continue_final_message is true"))
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    _check_kwargs = field_validator("chat_template_kwargs")(_check_template_kwargs)

    @model_validator(mode="after")
    def _check_chat(self) -> Any:
        if self.continue_final_message and self.add_generation_prompt:
            if "add_generation_prompt" in self.model_fields_set:
                raise ValueError("add_generation_prompt and continue_final_message are "
                                 "exclusive")
            self.add_generation_prompt = False  # the default yields to the request's choice
        return self


MAX_TOOLS = 128


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    #: The arguments' JSON Schema, given to the template as it is.
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingFields, _ChatRendering):
    """``POST /v1/chat/completions``."""

    model_config = ConfigDict(json_schema_extra={"allOf": [_STREAMING, _EXCLUSIVE, _LOGPROBS,
                                                           *_CONSTRAINTS]})
    max_completion_tokens: TokenCount | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = Field(None, description=(
        "most likely alternatives listed per token; needs logprobs: true"))
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(None, description=(
        "functions the model may call: rendered by the chat template, the calls parsed "
        "out of its answer"))
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description=(
            "none: no call; auto (the default with tools): the model's choice; required: "
            "one call or more (one where parallel_tool_calls is false), and a named "
            "function ({type: function, function: {name}}, one of tools): a call of it; "
            "both need tools, and are decoded within the calls' syntax and the functions' "
            "parameters (structured output)"))
    parallel_tool_calls: bool = Field(True, description="false: only the first call is returned")

    @model_validator(mode="after")
    def _check_tool_choice(self) -> Any:
        """A forced call needs tools, and a named one a function among them."""
        choice = self.tool_choice
        if choice == "required" or isinstance(choice, NamedToolChoice):
            names = {t.function.name for t in self.tools or ()}
            if not names:
                raise RequestError("tool_choice needs tools", param="tool_choice")
            if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
                raise RequestError(f"tool_choice names '{choice.function.name}', which is not "
                                   "in tools", param="tool_choice")
        return self

    def forced_tools(self) -> list[tuple[str, dict[str, Any] | None]] | None:
        """The functions a forced call may be of (``required``: any of tools; a named
        one: it), with their parameters' schemas; None where no call is forced."""
        choice = self.tool_choice
        if choice == "required":
            return [(t.function.name, t.function.parameters) for t in self.tools or ()]
        if isinstance(choice, NamedToolChoice):
            return [(t.function.name, t.function.parameters) for t in self.tools or ()
                    if t.function.name == choice.function.name]
        return None

    @property
    def constrained(self) -> bool:
        return super().constrained or self.forced_tools() is not None

    @property
    def tools_on(self) -> bool:
        """Whether the template gets the tools and the answer is parsed for calls."""
        return bool(self.tools) and self.tool_choice != "none"

    def tools_for_template(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools or ()] if self.tools_on else None

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return top

    @property
    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeCompletionRequest(_Strict):
    """``POST /tokenize`` with a prompt (vLLM's shape)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_ChatRendering):
    """``POST /tokenize`` with chat messages (vLLM's shape)."""

    model: str | None = None
    add_special_tokens: bool = False


class DetokenizeRequest(_Strict):
    """``POST /detokenize`` (vLLM's shape)."""

    model: str | None = None
    tokens: list[TokenId]


Model = TypeVar("Model", bound=BaseModel)


def check_model(requested: str | None, served: str) -> None:
    """404 for a model this daemon does not serve (``None``: not given, fine)."""
    if requested is not None and requested != served:
        raise ModelNotFound(f"The model `{requested}` does not exist.", param="model",
                            code="model_not_found")


#: A \uD800-\uDFFF escape: the only way a lone surrogate gets into a decoded body.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def load_json(body: bytes) -> Any:
    """The JSON value of ``body``; a 400 for anything that is not valid JSON text.

    Beyond syntax: bytes that are not UTF-8 (RFC 8259 requires it), nesting deeper
    than ``MAX_NESTING`` arrays and objects (RFC 8259 section 9 lets a parser limit it),
    and strings holding a lone surrogate (``"\\ud800"``, which no tokenizer can encode)
    are malformed bodies, not server errors.

    The depth bound is explicit, the same on every Python (issue 10, defect 1, Python
    3.12+): a body with at most ``MAX_NESTING`` ``[`` and ``{`` cannot nest deeper (two
    ``bytes.count``, about a millisecond for 4 MiB); any other is measured after parsing,
    level by level. ``json`` itself refuses absurd depths (``b"[" * 100_000``) with
    RecursionError on 3.11 (the interpreter's limit) and 3.12+ (the C recursion limit);
    that is the same 400. What parses (3.13 parses 5,000 levels) is refused by the
    measurement, before pydantic, ``json.dumps`` or the template see it.
    """
    try:
        text = body.decode("utf-8-sig")
        data = json.loads(text)
        if body.count(b"[") + body.count(b"{") > MAX_NESTING and nesting_exceeds(data):
            raise _too_deep()
        if _SURROGATE_ESCAPE.search(text):  # rare: emoji escaped as pairs, or a lone half
            json.dumps(data, ensure_ascii=False).encode()
    except UnicodeDecodeError as exc:
        raise RequestError(f"request body is not valid JSON: not UTF-8 ({exc.reason} at "
                           f"byte {exc.start})") from exc
    except UnicodeEncodeError as exc:
        raise RequestError("request body is not valid JSON: a string holds a lone "
                           "surrogate escape (\\ud800-\\udfff)") from exc
    except RecursionError as exc:
        raise _too_deep() from exc
    except ValueError as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from exc
    return data


def _too_deep() -> RequestError:
    return RequestError(f"request body is not valid JSON: nested too deeply (more than "
                        f"{MAX_NESTING} levels of arrays and objects)")


def parse(model: type[Model], body: bytes) -> Model:
    """Validate a JSON body; every failure becomes a 400 naming the parameter."""
    data = load_json(body)
    if not isinstance(data, dict):
        raise RequestError("request body must be a JSON object")
    try:
        return model.model_validate(without_unsupported(data))
    except ValidationError as exc:
        raise request_error(exc) from exc


def without_unsupported(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` less the unsupported parameters that ask for nothing; a 400 for any other."""
    for name in [n for n in UNSUPPORTED if n in data]:
        value = data[name]
        if not (value is None or value is False or value in _OFF.get(name, ())):
            raise RequestError(f"'{name}' is not supported: {UNSUPPORTED[name]}", param=name,
                               code="unsupported_parameter")
    return {k: v for k, v in data.items() if k not in UNSUPPORTED}


def request_error(exc: ValidationError) -> RequestError:
    first = exc.errors()[0]
    loc = [str(part) for part in first["loc"]]
    if first["type"] == "extra_forbidden":
        return RequestError(f"unknown parameter '{'.'.join(loc)}'", param=loc[0] if loc else None,
                            code="unknown_parameter")
    where = ".".join(loc)
    message = f"{where}: {first['msg']}" if where else first["msg"]
    return RequestError(message, param=loc[0] if loc else None)
