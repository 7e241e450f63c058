// Command infos prints the infos an echo-like env returns, as the Go client reads them
// (session.Info), on one JSON line: a reset, a step, and a step with message "nan" (an info
// JSON cannot write, sent as a Struct). Every number is tagged with its Go type
// ({"int64": n}, {"bigint": "digits"}, {"float64": x}; NaN and infinities as strings), so
// a reader sees the types, not only the values. It is the Go twin of clients/node/infos.js.
//
//	infos --target 127.0.0.1:50051
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"math/big"
	"os"
	"strconv"
	"time"

	"openenvgrpc/client/session"
	pb "openenvgrpc/gen/openenv_grpc/v1"
	echov1 "openenvgrpc/gen/openenv_grpc_envs/echo/v1"
)

// tagged is v with each number as a one-key object naming its Go type.
func tagged(v any) any {
	switch v := v.(type) {
	case int64:
		return map[string]any{"int64": v}
	case *big.Int:
		return map[string]any{"bigint": v.String()}
	case float64:
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return map[string]any{"float64": strconv.FormatFloat(v, 'g', -1, 64)}
		}
		return map[string]any{"float64": v}
	case map[string]any:
		out := make(map[string]any, len(v))
		for key, item := range v {
			out[key] = tagged(item)
		}
		return out
	case []any:
		out := make([]any, len(v))
		for i, item := range v {
			out[i] = tagged(item)
		}
		return out
	}
	return v
}

func run(target string) (map[string]any, error) {
	conn, err := session.Dial(target)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := session.Open(ctx, pb.NewEnvServiceClient(conn))
	if err != nil {
		return nil, err
	}
	defer s.Abandon()
	out := map[string]any{}
	step := func(message string) (*pb.StepResult, error) {
		return s.Step(&echov1.EchoAction{Kind: &echov1.EchoAction_Message{Message: message}})
	}
	results := []struct {
		name string
		call func() (*pb.StepResult, error)
	}{
		{"reset", func() (*pb.StepResult, error) { return s.Reset(-1, nil) }},
		{"step", func() (*pb.StepResult, error) { return step("a") }},
		{"nan", func() (*pb.StepResult, error) { return step("nan") }},
	}
	for _, r := range results {
		result, err := r.call()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", r.name, err)
		}
		info, err := session.Info(result)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", r.name, err)
		}
		out[r.name] = tagged(info)
	}
	return out, s.Close()
}

func main() {
	target := flag.String("target", "", "host:port of the server")
	flag.Parse()
	if *target == "" {
		fmt.Fprintln(os.Stderr, "usage: infos --target HOST:PORT")
		os.Exit(2)
	}
	out, err := run(*target)
	if err != nil {
		fmt.Fprintf(os.Stderr, "infos: %v\n", err)
		os.Exit(1)
	}
	line, err := json.Marshal(out)
	if err != nil {
		fmt.Fprintf(os.Stderr, "infos: %v\n", err)
		os.Exit(1)
	}
	fmt.Println(string(line))
}
