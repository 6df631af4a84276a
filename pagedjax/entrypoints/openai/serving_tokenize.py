"""/tokenize and /detokenize in vLLM's shapes (token ids of a prompt or of chat messages as
the chat endpoint would render them, and text of token ids)."""
from __future__ import annotations

from pagedjax.entrypoints.openai.errors import bad_request
from pagedjax.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from pagedjax.entrypoints.openai.serving_chat import ChatServing
from pagedjax.entrypoints.openai.serving_common import ServingBase


class TokenizeServing(ServingBase):
    """Handler of /tokenize and /detokenize (tokenizer work runs on the CPU worker thread)."""

    def __init__(self, chat: ChatServing) -> None:
        super().__init__(chat.engine, chat.served_model_name, chat.tokenizer, chat.cpu, chat.send_timeout)
        self.chat = chat

    def _check(self, req: TokenizeRequest | DetokenizeRequest) -> None:
        self.lora_of(req.model)  # an adapter shares the base model's tokenizer
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer")

    async def tokenize(self, req: TokenizeRequest) -> dict:
        self._check(req)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of `prompt` and `messages`", "prompt")
        return await self.run_cpu(self._tokenize, req)

    def _tokenize(self, req: TokenizeRequest) -> dict:
        if req.messages is not None:
            text = self.chat.render(req.messages, req.add_generation_prompt is not False,
                                    continue_final_message=bool(req.continue_final_message),
                                    chat_template_kwargs=req.chat_template_kwargs)
            ids = self.encode(text, "messages", add_special_tokens=bool(req.add_special_tokens))
        else:
            ids = self.encode(req.prompt, "prompt", add_special_tokens=req.add_special_tokens is not False)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        self._check(req)
        bad = next((t for t in req.tokens if t >= self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is out of range [0, {self.vocab_size})", "tokens")
        return {"prompt": await self.run_cpu(self.tokenizer.decode, req.tokens)}
