// Stream one reply from the quickstart relay with the official Anthropic
// TypeScript SDK: npm install && npm start (in examples/sdk/typescript)
import Anthropic from "@anthropic-ai/sdk";

// The relay speaks the Anthropic API: point the SDK at it, with a relay key.
const client = new Anthropic({
  baseURL: "http://localhost:8080",
  apiKey: "sk-relay-quickstart-demo",
});

async function main(): Promise<void> {
  const stream = client.messages.stream({
    model: "claude-sonnet-5-5",
    max_tokens: 64,
    messages: [{ role: "user", content: "Hello" }],
  });
  stream.on("text", (text) => process.stdout.write(text));
  await stream.finalMessage();
  process.stdout.write("\n");
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
