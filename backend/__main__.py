from backend.cli import end_process, main

end_process(main())
