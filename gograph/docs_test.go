package gograph

import (
	"go/ast"
	"go/parser"
	"go/printer"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"unicode"
)

// documentedSignatures returns the exported functions of this package as docs/CORE_API.md
// writes them: "Name(params) results", parameters as the source groups
// them, results by type only.
func documentedSignatures(t *testing.T) map[string]string {
	t.Helper()
	fset := token.NewFileSet()
	names, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, name := range names {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, 0)
		if err != nil {
			t.Fatalf("parsing %s: %v", name, err)
		}
		for _, d := range f.Decls {
			fn, ok := d.(*ast.FuncDecl)
			if !ok || fn.Recv != nil || !fn.Name.IsExported() {
				continue
			}
			out[fn.Name.Name] = fn.Name.Name + "(" + fields(fset, fn.Type.Params, true) + ")" + results(fset, fn.Type.Results)
		}
	}
	return out
}

func fields(fset *token.FileSet, fl *ast.FieldList, names bool) string {
	if fl == nil {
		return ""
	}
	var parts []string
	for _, f := range fl.List {
		var typ strings.Builder
		_ = printer.Fprint(&typ, fset, f.Type)
		if !names || len(f.Names) == 0 {
			for range max(1, len(f.Names)) {
				parts = append(parts, typ.String())
			}
			continue
		}
		var ns []string
		for _, n := range f.Names {
			ns = append(ns, n.Name)
		}
		parts = append(parts, strings.Join(ns, ", ")+" "+typ.String())
	}
	return strings.Join(parts, ", ")
}

func results(fset *token.FileSet, fl *ast.FieldList) string {
	r := fields(fset, fl, false)
	switch {
	case r == "":
		return ""
	case strings.Contains(r, ","):
		return " (" + r + ")"
	}
	return " " + r
}

// snake is gopy's -rename of a Go name.
func snake(name string) string {
	var b strings.Builder
	for i, r := range name {
		if unicode.IsUpper(r) {
			if i > 0 {
				b.WriteByte('_')
			}
			r = unicode.ToLower(r)
		}
		b.WriteRune(r)
	}
	return b.String()
}

var apiRow = regexp.MustCompile("^\\| `([A-Z]\\w*\\(.*?\\)[^`]*)` \\| `(\\w+)\\(")

// TestCoreAPIDocumentsEveryExport holds docs/CORE_API.md's tables to the
// exported functions: every export has one row, with its Go signature and
// its Python name, and every row names an export.
func TestCoreAPIDocumentsEveryExport(t *testing.T) {
	doc, err := os.ReadFile(filepath.Join("..", "docs", "CORE_API.md"))
	if err != nil {
		t.Fatal(err)
	}
	want := documentedSignatures(t)
	seen := map[string]bool{}
	for _, line := range strings.Split(string(doc), "\n") {
		m := apiRow.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		name := m[1][:strings.Index(m[1], "(")]
		sig, ok := want[name]
		switch {
		case !ok:
			t.Errorf("CORE_API.md documents %s, which is not an export", name)
		case m[1] != sig:
			t.Errorf("CORE_API.md: %s\n  the source says %s", m[1], sig)
		case m[2] != snake(name):
			t.Errorf("CORE_API.md: %s is called %s from Python, not %s", name, snake(name), m[2])
		}
		seen[name] = true
	}
	for name := range want {
		if !seen[name] {
			t.Errorf("CORE_API.md has no row for the export %s", want[name])
		}
	}
}

var fuzzFunc = regexp.MustCompile(`(?m)^func (Fuzz\w+)\(`)

// TestReliabilityListsEveryFuzzTarget holds docs/RELIABILITY.md's fuzz
// table to the module's Fuzz functions, named "package.FuzzName".
func TestReliabilityListsEveryFuzzTarget(t *testing.T) {
	var targets []string
	err := filepath.WalkDir("..", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (strings.HasPrefix(d.Name(), ".") || strings.HasPrefix(d.Name(), "_") || d.Name() == "vendor" || d.Name() == "build") && path != ".." {
			return filepath.SkipDir
		}
		if !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range fuzzFunc.FindAllStringSubmatch(string(src), -1) {
			targets = append(targets, filepath.Base(filepath.Dir(path))+"."+m[1])
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(targets)
	doc, err := os.ReadFile(filepath.Join("..", "docs", "RELIABILITY.md"))
	if err != nil {
		t.Fatal(err)
	}
	section := string(doc)
	if i := strings.Index(section, "## 8. Fuzzing"); i >= 0 {
		section = section[i:]
	}
	if i := strings.Index(section[3:], "\n## "); i >= 0 {
		section = section[:i+3]
	}
	listed := map[string]bool{}
	for _, m := range regexp.MustCompile("`(\\w+\\.Fuzz\\w+)`").FindAllStringSubmatch(section, -1) {
		listed[m[1]] = true
	}
	for _, target := range targets {
		if !listed[target] {
			t.Errorf("RELIABILITY.md's fuzz table does not list %s", target)
		}
		delete(listed, target)
	}
	for target := range listed {
		t.Errorf("RELIABILITY.md lists %s, which is no fuzz target", target)
	}
}
