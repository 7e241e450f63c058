// Command burst opens COUNT Session streams at once on ONE grpc-go connection, with no
// retry: what a plain Go client sees when it opens more sessions than the server holds.
// It prints one JSON line: how many opens were admitted, and every other outcome by
// status code, with or without the server's grpc-retry-pushback-ms hint.
//
//	burst TARGET COUNT [--write-first]
//
// --write-first sends a reset before the headers arrive (a client that does not wait to
// be admitted); by default each open waits for the headers, as session.Open does.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	pb "openenvgrpc/gen/openenv_grpc/v1"
)

type summary struct {
	Admitted int            `json:"admitted"`
	Outcomes map[string]int `json:"outcomes"`
}

func main() {
	if len(os.Args) < 3 {
		fmt.Fprintln(os.Stderr, "usage: burst TARGET COUNT [--write-first]")
		os.Exit(2)
	}
	count, err := strconv.Atoi(os.Args[2])
	if err != nil {
		fmt.Fprintln(os.Stderr, "COUNT must be a number")
		os.Exit(2)
	}
	writeFirst := len(os.Args) > 3 && os.Args[3] == "--write-first"
	conn, err := grpc.Dial(os.Args[1], grpc.WithInsecure())
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer conn.Close()
	client := pb.NewEnvServiceClient(conn)
	result := summary{Outcomes: map[string]int{}}
	var mu sync.Mutex
	var answered, release sync.WaitGroup
	release.Add(1)
	var finished sync.WaitGroup
	for i := 0; i < count; i++ {
		answered.Add(1)
		finished.Add(1)
		go func() {
			defer finished.Done()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			outcome, stream := open(ctx, client, writeFirst)
			mu.Lock()
			if outcome == "" {
				result.Admitted++
			} else {
				result.Outcomes[outcome]++
			}
			mu.Unlock()
			answered.Done()
			if stream != nil { // admitted: hold the session until every open is answered
				release.Wait()
				stream.CloseSend()
				stream.Recv()
			}
		}()
	}
	answered.Wait()
	release.Done()
	finished.Wait()
	out, _ := json.Marshal(result)
	fmt.Println(string(out))
}

// open returns "" and the stream when admitted, else the refusal's code and whether it
// carried a pushback hint.
func open(ctx context.Context, client pb.EnvServiceClient, writeFirst bool) (string, pb.EnvService_SessionClient) {
	stream, err := client.Session(ctx)
	if err != nil {
		return describe(err, nil), nil
	}
	if writeFirst {
		reset := &pb.SessionRequest{RequestId: 1, Command: &pb.SessionRequest_Reset_{Reset_: &pb.ResetCommand{}}}
		stream.Send(reset) // an error here shows again in Recv, with the real status
	}
	header, err := stream.Header()
	if err == nil && len(header.Get("openenv-env")) > 0 {
		return "", stream
	}
	// Not admitted: the status comes with Recv (a trailers-only response).
	for err == nil {
		_, err = stream.Recv()
	}
	return describe(err, stream), nil
}

func describe(err error, stream pb.EnvService_SessionClient) string {
	hint := "no pushback"
	if stream != nil && len(stream.Trailer().Get("grpc-retry-pushback-ms")) > 0 {
		hint = "pushback"
	}
	return fmt.Sprintf("%s (%s)", status.Code(err), hint)
}
