package relay

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// TestFleetRedisKeysDocumented: every Redis key the relay's code names
// has its row in docs/fleet.md's table of Redis keys, and every kind of
// hash tag the table names is one the code uses, so that neither drifts
// from the other. The code is read, not run: each call of the fleet's key
// (thing tag, what), each fleet.Tag("<kind>:", ...) and "<kind>:"+... that
// makes a thing, and each f.Prefix + "<name>" (the keys and pub/sub
// channels outside a hash tag).
func TestFleetRedisKeysDocumented(t *testing.T) {
	doc, err := os.ReadFile("docs/fleet.md")
	if err != nil {
		t.Fatal(err)
	}
	table := redisKeyTable(t, string(doc))

	// string literals that look like a thing's kind but make no key
	notKeys := map[string]string{"b:": "a batch's member in a holds set (holdMember)"}
	whats, kinds, prefixed := map[string]string{}, map[string]string{}, map[string]string{}
	fset := token.NewFileSet()
	var files []string // the module's source, the root and its packages
	err = filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && path != "." && (d.Name() == "testdata" || d.Name() == "bench" || d.Name() == "cmd" || strings.HasPrefix(d.Name(), ".")) {
			return filepath.SkipDir
		}
		if strings.HasSuffix(path, ".go") && !strings.HasSuffix(path, "_test.go") {
			files = append(files, path)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	kindLit := regexp.MustCompile(`^[a-z]:$`)
	for _, name := range files {
		f, err := parser.ParseFile(fset, name, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(f, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.CallExpr:
				sel, ok := n.Fun.(*ast.SelectorExpr)
				if ok && sel.Sel.Name == "Key" && len(n.Args) == 2 {
					if s, ok := leadingLiteral(n.Args[1]); ok {
						whats[s] = fset.Position(n.Pos()).String()
					}
					if s, ok := leadingLiteral(n.Args[0]); ok && !kindLit.MatchString(s) {
						kinds[s] = fset.Position(n.Pos()).String() // a fixed thing: nodes
					}
				}
				name := ""
				switch fn := n.Fun.(type) {
				case *ast.Ident:
					name = fn.Name
				case *ast.SelectorExpr:
					name = fn.Sel.Name
				}
				if (name == "tag" || name == "Tag") && len(n.Args) == 2 {
					if s, ok := leadingLiteral(n.Args[0]); ok {
						kinds[s] = fset.Position(n.Pos()).String()
					}
				}
			case *ast.BinaryExpr:
				if n.Op != token.ADD {
					break
				}
				if s, ok := literal(n.X); ok && kindLit.MatchString(s) && notKeys[s] == "" {
					kinds[s] = fset.Position(n.Pos()).String()
				}
				if sel, ok := n.X.(*ast.SelectorExpr); ok && (sel.Sel.Name == "prefix" || sel.Sel.Name == "Prefix") {
					if s, ok := leadingLiteral(n.Y); ok {
						prefixed[s] = fset.Position(n.Pos()).String()
					}
				}
			}
			return true
		})
	}
	if len(whats) < 8 || len(kinds) < 8 || len(prefixed) < 4 {
		t.Fatalf("read too few keys from the code (whats %v, kinds %v, prefixed %v): has the way keys are made changed?", whats, kinds, prefixed)
	}
	for s, where := range whats {
		if !strings.Contains(table, ":"+s) {
			t.Errorf("%s: the Redis key \"…:%s\" has no row in docs/fleet.md's table of Redis keys", where, s)
		}
	}
	for s, where := range kinds {
		if !strings.Contains(table, "{"+s) {
			t.Errorf("%s: the Redis keys of kind {%s…} have no row in docs/fleet.md's table of Redis keys", where, s)
		}
	}
	for s, where := range prefixed {
		if !strings.Contains(table, "`<prefix>"+s) {
			t.Errorf("%s: \"<prefix>%s\" has no row in docs/fleet.md's table of Redis keys", where, s)
		}
	}
	for _, m := range regexp.MustCompile(`\{([a-z]:)`).FindAllStringSubmatch(table, -1) {
		if kinds[m[1]] == "" {
			t.Errorf("docs/fleet.md's table of Redis keys names {%s…}, which the code does not make", m[1])
		}
	}
}

// redisKeyTable returns the rows of docs/fleet.md's table of Redis keys.
func redisKeyTable(t *testing.T, doc string) string {
	t.Helper()
	_, rest, ok := strings.Cut(doc, "\n| Redis key | what | expires |\n")
	if !ok {
		t.Fatal("docs/fleet.md has no table of Redis keys (| Redis key | what | expires |)")
	}
	table, _, _ := strings.Cut(rest, "\n\n")
	return table
}

// literal is the value of a string literal.
func literal(e ast.Expr) (string, bool) {
	lit, ok := e.(*ast.BasicLit)
	if !ok || lit.Kind != token.STRING {
		return "", false
	}
	s, err := strconv.Unquote(lit.Value)
	return s, err == nil
}

// leadingLiteral is the string literal e is or starts with ("owners:" of
// "owners:"+kind.String()).
func leadingLiteral(e ast.Expr) (string, bool) {
	for {
		b, ok := e.(*ast.BinaryExpr)
		if !ok || b.Op != token.ADD {
			return literal(e)
		}
		e = b.X
	}
}
