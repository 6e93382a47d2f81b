"""The prompt side of Engine: the documentation lookup's entries, the request's token ids (chat
template, raw text or ids), and the prompt fitted to the context (the oldest turns dropped
when it does not fit, with one clear message when nothing can). ``PromptFit`` is a part of
engine.generate.Engine, which is the public class.
"""

from __future__ import annotations

from .docs_lookup import DOCS_PER_QUESTION, DocEntry, last_user_text, with_docs_each
from .events import GenerateRequest


class PromptFit:
    """Part of engine.generate.Engine: reads ``tokenizer``, ``docs``, ``args`` and
    ``context_length``."""

    @property
    def has_chat_template(self) -> bool:
        """False when the store has no chat template: only raw prompts (GenerateRequest.prompt)
        can run; messages raise TokenizerError."""
        return self.tokenizer.has_chat_template

    def lookup(self, request: GenerateRequest) -> list[DocEntry]:
        """The documentation entries given with ``request`` (engine.docs_lookup): the best
        DOCS_PER_QUESTION matches of its last user message when the store ships a documentation
        index, the request is a chat and ``request.sampling.docs_lookup`` is on; else []."""
        if request.prompt_ids is not None:  # the caller did the lookup (the server) or none
            return list(request.docs_entries) if request.sampling.docs_lookup else []
        if self.docs is None or not request.sampling.docs_lookup:
            return []
        text = last_user_text(request.messages)
        return self.docs.search(text, DOCS_PER_QUESTION) if text else []

    def _encode_chat(self, messages, docs: bool) -> list[int]:
        if docs:  # each question with the block it is answered with (KV rows reused turn after turn)
            messages = with_docs_each(messages, lambda text: self.docs.search(text, DOCS_PER_QUESTION))
        return self.tokenizer.encode_chat(messages)

    def _docs_on(self, request: GenerateRequest) -> bool:
        return self.docs is not None and request.sampling.docs_lookup and request.prompt_ids is None

    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        """Token ids of the request's prompt (chat template with the documentation lookup's
        block before each user message, raw text or ids)."""
        return self._prompt_ids(request, self._docs_on(request))

    def _check_ids(self, what: str, ids) -> list[int]:
        """``ids`` as ints, each checked against the vocabulary (the kernels index the embedding
        without bounds checks). Raises ValueError naming ``what`` and the first bad id."""
        ids = [int(t) for t in ids]
        bad = [t for t in ids if not 0 <= t < self.args.vocab_size]
        if bad:
            raise ValueError(f"{what}: token id {bad[0]} is outside the vocabulary [0, {self.args.vocab_size})")
        return ids

    def _prompt_ids(self, request: GenerateRequest, docs: bool) -> list[int]:
        if request.prompt_ids is not None:
            return self._check_ids("prompt_ids", request.prompt_ids)
        if request.messages:
            return self._encode_chat(request.messages, docs)
        if request.prompt is not None:
            return self.tokenizer.encode(request.prompt)
        raise ValueError("empty request: give messages, prompt or prompt_ids")

    def answer_room(self, max_new_tokens: int) -> int:
        """Tokens a chat prompt must leave free for the answer: min(max_new_tokens, context / 4)
        (a long setting must not make every later message refuse to fit)."""
        return max(1, min(int(max_new_tokens), self.context_length // 4))

    def fit_prompt(self, request: GenerateRequest) -> tuple[list[int], int]:
        """(prompt token ids, oldest messages left out) for ``request``.

        A chat whose prompt leaves less than :meth:`answer_room` tokens of the context drops
        its oldest turns, a user message and the answers that follow it at a time, never the
        system prompt(s) at its start nor the last user message. Among the shortened prompts
        that fit, the one sharing the longest prefix with the KV rows kept from the previous
        generation wins (so the next turns of a trimmed chat still reuse the prefill); with no
        such prefix, enough turns are dropped to leave a quarter of the context free for the
        turns to come. Raw prompts and token ids are never shortened (0 dropped). The result
        may still not fit: :meth:`generate` refuses it then. With the documentation lookup each
        user message keeps its block right before it, so a dropped turn takes its block along.
        """
        return self._fit_prompt(request, self._docs_on(request))

    def _surely_too_long(self, request: GenerateRequest) -> bool:
        """True when the last user message's text alone needs more tokens than the context
        holds, by a lower bound (characters / the longest vocabulary entry): a long paste is
        then encoded once, alone, before it is refused. Never changes a result: a bound that
        misjudges (a normalizer that removes characters) costs one more encoding."""
        if request.prompt_ids is not None or not request.messages:
            return False
        text = last_user_text(request.messages) or ""
        return len(text) > self.context_length * self.tokenizer.max_token_chars

    def _fit_prompt(self, request: GenerateRequest, docs: bool) -> tuple[list[int], int]:
        msgs = request.messages
        head = 0
        while msgs and head < len(msgs) and msgs[head].role == "system":
            head += 1
        starts = [i for i in range(head + 1, len(msgs or ())) if msgs[i].role == "user"]
        C = self.context_length
        room = self.answer_room(request.sampling.max_new_tokens)
        last = None
        if starts and self._surely_too_long(request):
            # the last question alone first: the whole chat (as long) need not be encoded
            last = self._encode_chat(tuple(msgs[:head]) + tuple(msgs[starts[-1]:]), docs)
            if len(last) + room > C:
                return last, starts[-1] - head
        ids = self._prompt_ids(request, docs)
        if request.prompt_ids is not None or not msgs:
            return ids, 0
        if len(ids) + room <= C:
            return ids, 0
        if not starts:
            return ids, 0
        # the last question alone: when even it does not fit, no shorter prompt does (each
        # encoding of a long paste costs as much as the first)
        if last is None:
            last = self._encode_chat(tuple(msgs[:head]) + tuple(msgs[starts[-1]:]), docs)
        if len(last) + room > C:
            # send it alone (the answer gets what is left) or let generate() refuse it
            return last, starts[-1] - head
        cands = []  # (start, ids) that fit, fewest dropped first
        for st in starts[:-1]:
            c = self._encode_chat(tuple(msgs[:head]) + tuple(msgs[st:]), docs)
            if len(c) + room <= C:
                cands.append((st, c))
        cands.append((starts[-1], last))

        def common(c: list[int]) -> int:
            n = 0
            for x, y in zip(c, self._kv_ids):
                if x != y:
                    break
                n += 1
            return n
        base = common(cands[-1][1])  # what every candidate shares (the system prompt, template head)
        best = max(cands, key=lambda sc: common(sc[1]))
        if common(best[1]) <= base:
            slack = C - room - C // 4
            best = next((sc for sc in cands if len(sc[1]) <= slack), cands[-1])
        return best[1], best[0] - head

    def _overflow_message(self, n: int, chat: bool, dropped: int = 0) -> str:
        C, limit = self.context_length, int(self.args.max_position_embeddings)
        what = "The message" if chat else "The prompt"
        s = (f"{what} has {n} tokens but the context holds {C} tokens (one more is needed to answer)"
             + (f"; the {dropped} earlier messages were already left out" if dropped else "") + ". Shorten it")
        if C < limit:
            s += f", or raise the context length (this model takes up to {limit} tokens)"
        else:
            s += f" (this model takes at most {limit} tokens)"
        return s + "."
