// Renders an Ollama Modelfile TEMPLATE as Ollama does (Go text/template over .Messages), for tests/export/test_gguf.py:
// stdin {"Template": "...", "Messages": [{"Role": "user", "Content": "..."}]}, stdout the rendered prompt.
package main

import (
	"encoding/json"
	"os"
	"text/template"
)

type Message struct {
	Role    string
	Content string
}

func main() {
	var input struct {
		Template string
		Messages []Message
	}
	if err := json.NewDecoder(os.Stdin).Decode(&input); err != nil {
		panic(err)
	}
	t := template.Must(template.New("m").Parse(input.Template))
	if err := t.Execute(os.Stdout, map[string]any{"Messages": input.Messages}); err != nil {
		panic(err)
	}
}
