package kvpipe_test

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// Every reference to the format document names a section it has, and none
// points to a specification outside the repository.
func TestFormatReferencesResolve(t *testing.T) {
	doc, err := os.ReadFile("docs/FORMAT.md")
	if err != nil {
		t.Fatal(err)
	}
	sections := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^#+ <a id="[^"]+"></a>([0-9.]+?)\.? `).FindAllStringSubmatch(string(doc), -1) {
		sections[strings.TrimSuffix(m[1], ".")] = true
	}
	if len(sections) < 10 {
		t.Fatalf("found %d numbered sections in docs/FORMAT.md; the heading pattern has drifted", len(sections))
	}
	ref := regexp.MustCompile(`FORMAT\.md (?:§[0-9.]+(?:(?:-| and |, )§[0-9.]+)*)`)
	num := regexp.MustCompile(`§([0-9]+(?:\.[0-9]+)*)`)
	refs := 0
	err = filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && path != "." && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata" && path != "wire/testdata") {
			return filepath.SkipDir
		}
		switch filepath.Ext(path) {
		case ".go", ".md", ".py", ".sh":
		default:
			return nil
		}
		if path == "docs_test.go" {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		if strings.Contains(string(b), "SPEC section") || strings.Contains(string(b), "(SPEC ") {
			t.Errorf("%s cites a SPEC outside the repository; point it to docs/FORMAT.md", path)
		}
		for _, r := range ref.FindAllString(string(b), -1) {
			for _, n := range num.FindAllStringSubmatch(r, -1) {
				refs++
				if !sections[n[1]] {
					t.Errorf("%s: %q names §%s, which docs/FORMAT.md does not have", path, r, n[1])
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if refs == 0 {
		t.Error("no reference to docs/FORMAT.md found; the pattern has drifted")
	}
}

// The README's embedding snippet is the Example's code: every line of it,
// in order, is a line of example_test.go, so it compiles and runs.
func TestReadmeEmbeddingIsTheExample(t *testing.T) {
	snippetIsExample(t, "## Embedding kvpipe in a router", "example_test.go", 10)
}

// The README's EAGLE snippet is Example_eagle's code.
func TestReadmeEagleIsTheExample(t *testing.T) {
	snippetIsExample(t, "Speculative decoding (EAGLE)", "example_eagle_test.go", 3)
}

// snippetIsExample checks that every line of the first Go snippet after
// heading in the README is, in order, a line of file, and that it has at
// least minLines.
func snippetIsExample(t *testing.T, heading, file string, minLines int) {
	t.Helper()
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	example, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	section := string(readme)
	start := strings.Index(section, heading)
	if start < 0 {
		t.Fatalf("README has no section %q", heading)
	}
	section = section[start:]
	open := strings.Index(section, "```go\n")
	if open < 0 {
		t.Fatal("the embedding section has no Go snippet")
	}
	snippet := section[open+len("```go\n"):]
	snippet = snippet[:strings.Index(snippet, "```")]
	lines := func(s string) []string {
		var out []string
		for _, l := range strings.Split(s, "\n") {
			if l = strings.TrimSpace(l); l != "" {
				out = append(out, l)
			}
		}
		return out
	}
	want, have := lines(snippet), lines(string(example))
	if len(want) < minLines {
		t.Fatalf("the snippet has %d lines; the section's layout has drifted", len(want))
	}
	i := 0
	for _, l := range have {
		if i < len(want) && l == want[i] {
			i++
		}
	}
	if i < len(want) {
		t.Errorf("README line %q (and any after it) is not in %s in that order", want[i], file)
	}
}
