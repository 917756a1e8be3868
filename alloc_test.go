package kvpipe_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// allocTest is the pattern test.sh runs without the race detector, whose
// own allocations would make an allocation count meaningless.
const allocTest = "Allocat"

// Every test that counts allocations is one test.sh's allocation pass runs:
// its name matches the pattern, and its package is on the list the script
// derives. A test named otherwise would run only under -race, where such
// tests skip, and so nowhere.
func TestAllocationTestsRunWithoutRace(t *testing.T) {
	var missed []string
	pkgs := map[string]bool{}
	fset := token.NewFileSet()
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && path != "." && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata") {
			return filepath.SkipDir
		}
		if !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, 0)
		if err != nil {
			return err
		}
		for _, decl := range f.Decls {
			fn, ok := decl.(*ast.FuncDecl)
			if !ok || fn.Body == nil || !strings.HasPrefix(fn.Name.Name, "Test") || !countsAllocations(fn.Body) {
				continue
			}
			pkg := "./" + filepath.Dir(path)
			if filepath.Dir(path) == "." {
				pkg = "." // the root package, as test.sh lists it
			}
			pkgs[pkg] = true
			if !strings.Contains(fn.Name.Name, allocTest) {
				missed = append(missed, path+": "+fn.Name.Name)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range missed {
		t.Errorf("%s counts allocations but its name lacks %q: test.sh's allocation pass would not run it", m, allocTest)
	}
	if len(pkgs) == 0 {
		t.Fatal("no test counts allocations: the walk has drifted")
	}
	out, err := exec.Command("bash", "test.sh", "--alloc-packages").Output()
	if err != nil {
		t.Fatalf("test.sh --alloc-packages: %v", err)
	}
	listed := strings.Fields(string(out))
	for p := range pkgs {
		if !slices.Contains(listed, p) {
			t.Errorf("%s has an allocation test that test.sh's pass (%v) leaves out", p, listed)
		}
	}
	if script, _ := os.ReadFile("test.sh"); !regexp.MustCompile(`-run '` + allocTest + `'`).Match(script) {
		t.Errorf("test.sh no longer runs -run '%s'", allocTest)
	}
}

// countsAllocations reports whether a body calls testing.AllocsPerRun or
// reads a benchmark-style allocation count (testing.Benchmark's AllocsPerOp).
func countsAllocations(body *ast.BlockStmt) bool {
	found := false
	ast.Inspect(body, func(n ast.Node) bool {
		if sel, ok := n.(*ast.SelectorExpr); ok && (sel.Sel.Name == "AllocsPerRun" || sel.Sel.Name == "AllocsPerOp") {
			found = true
		}
		return !found
	})
	return found
}
