// Command go streams one reply from the quickstart relay with the official
// Anthropic Go SDK and prints its text as it arrives: go run ./examples/sdk/go
package main

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/anthropics/anthropic-sdk-go/v2"
	"github.com/anthropics/anthropic-sdk-go/v2/option"
)

func main() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	// The relay speaks the Anthropic API: point the SDK at it, with a relay key.
	client := anthropic.NewClient(
		option.WithBaseURL("http://localhost:8080"),
		option.WithAPIKey("sk-relay-quickstart-demo"),
	)

	stream := client.Messages.NewStreaming(ctx, anthropic.MessageNewParams{
		Model:     anthropic.ModelClaudeSonnet5_5,
		MaxTokens: 64,
		Messages: []anthropic.MessageParam{
			anthropic.NewUserMessage(anthropic.NewTextBlock("Hello")),
		},
	})
	for stream.Next() {
		// Only content_block_delta events with a text delta carry text.
		if event, ok := stream.Current().AsAny().(anthropic.ContentBlockDeltaEvent); ok {
			if delta, ok := event.Delta.AsAny().(anthropic.TextDelta); ok {
				fmt.Print(delta.Text)
			}
		}
	}
	if err := stream.Err(); err != nil {
		log.Fatal(err)
	}
	fmt.Println()
}
