package fakeupstream

// Answer is a realistic answer of a model (prose, a list, inline code and a
// Go block), for tests that need a stream whose tokens are known.
var Answer = `Great question! There are a few reasons why your Go program might be leaking goroutines, and the most common one is a blocked channel send. When a goroutine tries to send on an unbuffered channel and nobody is receiving, it waits forever. Here's how you can find out what's going on:

1. **Take a goroutine dump.** Send the process a SIGQUIT (or call ` + "`" + `runtime.Stack` + "`" + ` with ` + "`" + `all` + "`" + ` set to true) and look for goroutines that have been blocked for a long time. The dump tells you the exact line each goroutine is waiting on.
2. **Use pprof.** If you import ` + "`" + `net/http/pprof` + "`" + `, you can visit ` + "`" + `/debug/pprof/goroutine?debug=2` + "`" + ` to see the same information while the program runs. Comparing two snapshots taken a minute apart usually makes the leak obvious.
3. **Check your contexts.** Every goroutine that does I/O should watch a context and return when it is canceled. A common mistake is to create a context with a timeout but forget to pass it down to the function that actually blocks.

In your snippet, the worker reads from ` + "`" + `jobs` + "`" + ` but never checks ` + "`" + `ctx.Done()` + "`" + `, so when the producer returns early, the workers wait forever. A simple fix is to select on both channels:

` + "`" + `` + "`" + `` + "`" + `go
for {
	select {
	case <-ctx.Done():
		return
	case j, ok := <-jobs:
		if !ok {
			return
		}
		process(j)
	}
}
` + "`" + `` + "`" + `` + "`" + `

With this change, canceling the context stops every worker, and the goroutine count goes back to where it started. Let me know if you'd like me to walk through the rest of the code as well!
`

// AnswerTokens is how many tokens Answer is by the published Claude
// tokenizer (the npm package @anthropic-ai/tokenizer 0.0.4).
const AnswerTokens = 384

// Deltas splits text into the text deltas of a stream, n words each (a word
// with the spaces that follow it), as a model streams a few tokens at a time.
func Deltas(text string, n int) []string {
	var out []string
	for text != "" {
		end := 0
		for w := 0; w < n && end < len(text); w++ {
			for end < len(text) && text[end] != ' ' && text[end] != '\n' {
				end++
			}
			for end < len(text) && (text[end] == ' ' || text[end] == '\n') {
				end++
			}
		}
		out = append(out, text[:end])
		text = text[end:]
	}
	return out
}
