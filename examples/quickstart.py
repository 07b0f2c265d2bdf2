"""Generate and chat with the bundled SmolLM2-135M-Instruct on the CPU (no downloads).

python examples/quickstart.py
"""

from dfllm import LLM, SamplingParams


def main() -> None:
    llm = LLM()  # the bundled default chat model, converted once from its GGUF into a local cache
    params = SamplingParams(temperature=0.0, max_tokens=48)

    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {"role": "system", "content": "You are a poet."},
            {"role": "user", "content": "Finish this haiku: 'Autumn moonlight / a worm digs silently'"},
        ],
        [{"role": "user", "content": "Give me three tips for writing clean Python."}],
    ]
    for out in llm.chat(conversations, params):
        reply = out.outputs[0]
        print(
            f"--- {len(out.prompt_token_ids)} prompt tokens, {len(reply.token_ids)} generated "
            f"({reply.finish_reason})\n{reply.text.strip()}\n"
        )

    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=42, max_tokens=24, stop=["\n"])
    for out in llm.generate(["Once upon a time", "The three laws of robotics are"], seeded, use_tqdm=False):
        print(repr(out.prompt), "->", repr(out.outputs[0].text))


if __name__ == "__main__":
    main()
