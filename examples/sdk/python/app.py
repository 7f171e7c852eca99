"""Stream one reply from the quickstart relay with the official Anthropic
Python SDK: pip install anthropic && python examples/sdk/python/app.py"""

import anthropic

# The relay speaks the Anthropic API: point the SDK at it, with a relay key.
client = anthropic.Anthropic(
    base_url="http://localhost:8080",
    api_key="sk-relay-quickstart-demo",
)

with client.messages.stream(
    model="claude-sonnet-5-5",
    max_tokens=64,
    messages=[{"role": "user", "content": "Hello"}],
) as stream:
    for text in stream.text_stream:
        print(text, end="", flush=True)
print()
